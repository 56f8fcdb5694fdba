"""``model.onnx``: the program converted for ONNX Runtime, kept only when ONNX Runtime reproduces editkit's scoring.

The program (:mod:`editkit.io.program`) is ordinary core ATen ops once the tangent interpreter has written f_lin out,
so torch's own ONNX exporter converts it op by op (``torch.onnx.export(..., dynamo=True)``, through onnxscript). The
ONNX model takes the program's inputs by their names (``pixels``; ``input_ids``, ``attention_mask``) with a dynamic
``batch`` (and ``length``) dimension, and gives one output per task, named after it, in the manifest's task order.

Before it is kept, ONNX Runtime runs it on the examples the program was checked on, against editkit's own logits
(:func:`~editkit.io.program.expected_logits`) within the program's own tolerance. A conversion that fails or differs
is not written; neither is one without the optional packages (``editkit[onnx]``). Either way the manifest's ``onnx``
says why in one line and the rest of the export (the program first) is written as before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from editkit.errors import ExportError
from editkit.io.layout import ONNX_EXTRA, ONNX_FILE, quiet_export
from editkit.io.program import VERIFY_TOLERANCE, Expected, logit_difference
from editkit.io.read import OnnxModel

log = logging.getLogger(__name__)

#: What converting and checking ``model.onnx`` imports (the ``onnx`` extra).
PACKAGES = ("onnx", "onnxscript", "onnxruntime")


class OnnxSkipped(ExportError):
    """``model.onnx`` is not written; the message is the one line the manifest and the command give."""


def missing_packages() -> list[str]:
    """The packages of :data:`PACKAGES` this environment lacks."""
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's own chatter (its progress lines, the renaming of shared dynamic axes) is not the user's to
    read: what matters is whether the file was kept, which the manifest and the command say."""
    with quiet_export(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def convert(program: Any, inputs: Sequence[str], tasks: Sequence[str], path: Path,
            dynamic: tuple[dict[int, Any], ...]) -> dict[str, Any]:
    """Write ``program`` (a ``torch.export`` program of ``{task: logits}``) to ``path`` as ONNX; what was written."""
    import torch

    try:
        with _quiet():
            converted = torch.onnx.export(program, (), dynamo=True, input_names=list(inputs),
                                          output_names=list(tasks), dynamic_shapes=dynamic, verbose=False)
            converted.save(str(path))
    except Exception as exc:  # the exporter's own errors (an op without a translation...): its text in the log only
        log.info("torch.onnx could not convert the program: %s", exc)
        raise OnnxSkipped(f"{ONNX_FILE} was not written: torch.onnx could not convert the program "
                          f"({type(exc).__name__} inside the exporter; its message is in the log); model.pt2 is "
                          "kept") from exc
    opsets = {domain or "ai.onnx": version for domain, version in converted.model.opset_imports.items()}
    return {"file": ONNX_FILE, "files": sorted(p.name for p in path.parent.glob(f"{ONNX_FILE}*")),
            "inputs": list(inputs), "outputs": list(tasks), "opset": opsets.get("ai.onnx")}


def check(path: Path, expected: Expected) -> dict[str, Any]:
    """Run ``path`` in ONNX Runtime on the expected examples; refuse (:class:`OnnxSkipped`) logits beyond the
    program's tolerance. Returns what was measured."""
    import onnxruntime

    measured = logit_difference(OnnxModel(path), expected)
    if not measured["within_tolerance"]:
        raise OnnxSkipped(f"{ONNX_FILE} was not written: ONNX Runtime's logits differ from editkit's by up to "
                          f"{measured['max_abs_logit_difference']:.3g} (largest logit "
                          f"{measured['largest_abs_logit']:.3g}, tolerance {VERIFY_TOLERANCE:g} of it) on "
                          f"{measured['examples']} test examples; model.pt2 is kept")
    return {**measured, "runtime": f"onnxruntime {onnxruntime.__version__}"}


def write_onnx(program: Any, inputs: Sequence[str], tasks: Sequence[str], directory: Path,
               dynamic: tuple[dict[int, Any], ...], expected: Expected) -> dict[str, Any]:
    """``directory/model.onnx`` of ``program``, checked against ``expected``; the manifest's ``onnx``: what was
    written and measured, or ``{"skipped": one line}`` with nothing written."""
    missing = missing_packages()
    if missing:
        return {"skipped": f"{ONNX_FILE} was not written: {', '.join(missing)} not installed ({ONNX_EXTRA})"}
    path = directory / ONNX_FILE
    try:
        written = convert(program, inputs, tasks, path, dynamic)
        return {**written, "verified": check(path, expected)}
    except OnnxSkipped as exc:
        for leftover in directory.glob(f"{ONNX_FILE}*"):
            leftover.unlink()
        return {"skipped": str(exc)}
