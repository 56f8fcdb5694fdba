"""Bridges to other libraries' objects (Avalanche)."""
