"""The export directory's names and format tag: what its writer and every reader of it agree on.

Kept apart from the writers so a reader (``editkit predict``, :mod:`editkit.io.read`) imports this and torch alone.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

PROGRAM_FILE = "model.pt2"
#: The program converted for ONNX Runtime (:mod:`editkit.io.onnx`), when it reproduces the scoring.
ONNX_FILE = "model.onnx"
#: How a user gets the optional packages ``model.onnx`` needs (written and run).
ONNX_EXTRA = "pip install 'editkit[onnx]'"
MANIFEST_FILE = "editkit.json"
CARD_FILE = "README.md"
HEADS_FILE = "heads.safetensors"
ADAPTER_SUBDIR = "adapter"
#: What ``editkit.json`` says it is; a reader refuses another format or a newer version.
EXPORT_FORMAT, FORMAT_VERSION = "editkit-export", 1


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """torch.export's own deprecation warning from deep-copying its tree specs (torch 2.13, inside torch) is not
    the user's to read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield
