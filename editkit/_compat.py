"""Make torchvision importable next to the CPU build of torch; import avalanche without its solver warning.

PyPI only ships a CUDA build of torchvision 0.28.0. Next to torch 2.13.0+cpu its
compiled extension (``torchvision/_C.so``) cannot load, and ``import torchvision``
then dies in ``_meta_registrations.py`` with ``operator torchvision::nms does not
exist``. open_clip, avalanche and parts of transformers import torchvision, so
editkit would be unusable.

The fix: before torchvision is first imported, try to load its extension
ourselves; only if that fails, declare the schemas of the two operators that
torchvision's Python code registers fake kernels for (``nms`` and ``qnms``).
Transforms, datasets and models then import; calling ``nms`` itself would still
fail (it has no kernel), which editkit never does.

Loading that extension needs torch, which ``import editkit`` must not import (the
command line answers ``--help`` without it). So ``import editkit`` only puts
:class:`TorchvisionShim` on ``sys.meta_path``: the fix runs when torchvision is
first looked up, by whichever library asks first, and never when nothing does.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None  # kept alive: dropping it unregisters the schemas

#: The same fix as source text, for a Python process that must not import editkit (the checks that an exported
#: model needs nothing of it) and imports what may import torchvision: prepended to its code.
STANDALONE_SHIM = f"""
import sys
import torch
try:
    import torchvision  # noqa: F401
except RuntimeError:
    for name in [m for m in sys.modules if m.startswith("torchvision")]:
        del sys.modules[name]
    library = torch.library.Library("torchvision", "DEF")
    for schema in {_SCHEMAS!r}:
        library.define(schema)
"""


def _extension_loads(package_dir: str) -> bool:
    import torch

    libs = glob.glob(os.path.join(package_dir, "_C*.so")) + glob.glob(os.path.join(package_dir, "_C*.pyd"))
    if not libs:
        return False
    try:
        torch.ops.load_library(libs[0])
    except OSError:
        return False
    return True


def ensure_torchvision_importable() -> bool:
    """Declare torchvision's op schemas if its compiled ops cannot load.

    Returns True when the shim was installed, False when it was not needed
    (torchvision absent, already imported, or its extension loads fine).
    """
    global _library
    if _library is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    if _extension_loads(spec.submodule_search_locations[0]):
        return False
    if _op_exists("torchvision::nms"):  # someone declared the schemas already
        return False
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)
    log.debug("torchvision's compiled ops did not load; declared nms/qnms schemas so it imports")
    return True


def _op_exists(qualname: str) -> bool:
    import torch

    try:
        torch._C._get_schema(qualname, "")
    except RuntimeError:
        return False
    return True


class TorchvisionShim(importlib.abc.MetaPathFinder):
    """Runs :func:`ensure_torchvision_importable` when torchvision is first looked up, then steps aside.

    It finds nothing itself (``None``: the ordinary finders import torchvision) and leaves
    ``sys.meta_path`` before running the fix, whose own ``find_spec("torchvision")`` would
    otherwise come back to it.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" and self in sys.meta_path:
            sys.meta_path.remove(self)
            ensure_torchvision_importable()
        return None


def install_torchvision_shim() -> None:
    """Arrange for :func:`ensure_torchvision_importable` to run before torchvision's first import.

    Nothing is imported now; once torchvision is imported (or the fix ran), this does nothing.
    """
    if "torchvision" in sys.modules or _library is not None:
        return
    if not any(isinstance(finder, TorchvisionShim) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionShim())


@contextlib.contextmanager
def quiet_avalanche_import() -> Iterator[None]:
    """Import avalanche modules inside this block.

    Avalanche imports qpsolvers for its GEM strategy, which editkit never uses, and
    qpsolvers warns on every import that no QP solver is installed; that one warning
    is silenced here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no QP solver found", category=UserWarning)
        yield
