"""Which packages the distribution holds; everything else about it is in ``pyproject.toml``.

The package list is derived here rather than written out in ``pyproject.toml``: a hand-kept list
silently drops a subpackage nobody remembered to add (the wheel would import fine in the checkout
and fail once installed), and ``[tool.setuptools.packages.find]`` cannot add a package that lives
outside ``editkit/``. The user's layout keeps the built-in scenario files in the top-level
``scenarios/`` folder; the wheel installs that folder as the package ``editkit.scenarios``. The root
``cli.py`` (a face for ``python cli.py``) and ``tests/`` are not part of the distribution.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["editkit", "editkit.*"]) + ["editkit.scenarios"],
    package_dir={"editkit.scenarios": "scenarios"},
    package_data={"editkit.scenarios": ["*.toml"]},
)
