"""Combining task vectors: task arithmetic, TIES-merging and the coefficient rules.

``MERGE_METHODS``: method name -> record whose ``build(vectors, **options)`` takes the
task vectors by name (a mapping that may load each one only when it is read) and
returns the vectors whose sum, scaled by one coefficient alpha, is added to theta_0:
task arithmetic returns its input unchanged, TIES-merging one merged vector. The
built-in methods register themselves in their own modules, imported below.
"""

from editkit.core.registry import Record, Registry

MERGE_METHODS: Registry[Record] = Registry("merge method")

from editkit.merge import arithmetic, ties  # noqa: E402,F401  (built-in extensions register themselves)
