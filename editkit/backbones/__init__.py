"""Backbone families. Each module builds a ``Backbone`` (see ``base.py``)."""

from .base import Backbone, state_fingerprint

__all__ = ["Backbone", "state_fingerprint"]
