"""Plain functions the tests share: generated data (``vision``, ``tabular``), tiny models (``models``) and
text corpora registered for a test (``text``).

Importable from any test directory because ``tests/`` is on pytest's ``pythonpath``.
"""
