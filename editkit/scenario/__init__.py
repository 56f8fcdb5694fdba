"""Scenario files (TOML, under the top-level ``scenarios/``) parsed, checked and built into streams."""
