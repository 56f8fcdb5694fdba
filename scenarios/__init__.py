"""The built-in scenario files (one TOML file per scenario); installed as the package ``editkit.scenarios``."""
