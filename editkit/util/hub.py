"""The Hugging Face hub as seen from here: its address, its local cache, and whether it answers.

Nothing here downloads; callers decide (and ``editkit.settings.offline_mode`` can forbid it).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


def host_reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout`` seconds.

    Runs in a daemon thread so that a DNS lookup stuck on a dead network cannot
    block the caller past the timeout.
    """
    parsed = urlparse(url)
    host = parsed.hostname
    if not host:
        return False
    port = parsed.port or (443 if parsed.scheme != "http" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def hf_endpoint() -> str:
    """The hub's base URL (``HF_ENDPOINT`` as huggingface_hub reads it)."""
    try:
        from huggingface_hub import constants

        return str(getattr(constants, "ENDPOINT", "https://huggingface.co"))
    except ImportError:  # pragma: no cover
        return "https://huggingface.co"


def hf_hub_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """The hub cache to read: ``cache_dir`` (``~`` expanded), else the one huggingface_hub uses
    (``HF_HOME`` / ``HF_HUB_CACHE``). CLIP weights and dataset snapshots are both looked up here."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)
