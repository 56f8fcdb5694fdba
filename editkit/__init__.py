"""editkit: continual-learning model editing with linearized fine-tuning and tauJp.

Importing editkit first makes torchvision importable next to the CPU build of
torch (see ``_compat``), so open_clip and avalanche work on a fresh CPU machine.
Heavy modules (avalanche, open_clip, transformers) are imported lazily where used.
"""

from editkit._compat import ensure_torchvision_importable

ensure_torchvision_importable()

__version__ = "0.1.0"
