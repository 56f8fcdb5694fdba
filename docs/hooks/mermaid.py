"""MkDocs hook: the site draws its Mermaid diagrams offline too.

Material draws a ``mermaid`` fence with the Mermaid script, which it fetches from a CDN unless the page already
loaded one: offline, or behind a firewall, a reader sees the diagram's source (``flowchart LR ...``) instead of
the diagram. Each build copies the script beside the pages, from a wheel that vendors it (artoo-mermaid, pinned by
sha256 and read as a zip, never installed; the script itself is checked against its own sha256), and loads it on
every page, so Material finds it and never reaches for the network.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mkdocs.exceptions import PluginError

from editkit.core.artifacts import PinnedArtifact, extract_member, fetch

#: Mermaid 11.16.0 (MIT), as the wheel vendors it.
MERMAID_WHEEL = PinnedArtifact(
    "mermaid", "wheel", "artoo-mermaid", "11.16.0",
    "fa6d2c8c0fbc4be09a456bfdd62f92eb85e44299a02460b1f4fd4f200a19f01d", "artoo_mermaid-11.16.0-py3-none-any.whl")
MEMBER = "artoo_mermaid/assets/mermaid.min.js"
SCRIPT_SHA256 = "74d7c46dabca328c2294733910a8aa1ed0c37451776e8d5295da38a2b758fb9b"
#: Where the script lies in the site, and the path every page loads it from.
SCRIPT = "assets/javascripts/mermaid.min.js"


def on_config(config):
    config.extra_javascript.append(SCRIPT)
    return config


def on_post_build(config) -> None:
    target = extract_member(fetch(MERMAID_WHEEL), MEMBER, Path(config.site_dir) / SCRIPT)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != SCRIPT_SHA256:
        target.unlink()
        raise PluginError(f"{MEMBER} of {MERMAID_WHEEL.filename} has sha256 {digest}, not {SCRIPT_SHA256}")
