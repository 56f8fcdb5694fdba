"""Plain functions the tests share: generated data (``vision``, ``tabular``) and tiny models (``models``).

Importable from any test directory because ``tests/`` is on pytest's ``pythonpath``.
"""
