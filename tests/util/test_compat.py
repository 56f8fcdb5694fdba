"""The torchvision import shim (``editkit._compat``), checked in fresh interpreters.

Whether torchvision's compiled ops load depends on the machine (a CUDA build of
torchvision next to CPU torch: they do not). The tests ask ``_extension_loads``
first and expect the matching behaviour, so they hold on either kind of machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
COMPAT_FILE = REPO / "editkit" / "_compat.py"

# Loads _compat.py as a standalone module: ``import editkit._compat`` would run
# editkit/__init__.py, whose import hook runs the shim at the first look-up of torchvision.
LOAD_STANDALONE = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compat_standalone", {str(COMPAT_FILE)!r})
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)
tv_spec = importlib.util.find_spec("torchvision")
assert tv_spec is not None, "torchvision is not installed"
"""


def run_python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_editkit_then_heavy_libraries():
    out = run_python("""
        import json, sys
        import editkit
        import editkit._compat as compat
        before = [m in sys.modules for m in ("torch", "torchvision")]
        import torchvision, torchvision.transforms, open_clip, avalanche.benchmarks
        calls = [compat.ensure_torchvision_importable(), compat.ensure_torchvision_importable()]
        t = torchvision.transforms.Compose([torchvision.transforms.ToTensor()])
        print(json.dumps({"before": before, "calls": calls, "modules": [m in sys.modules for m in
              ("torchvision", "torchvision.transforms", "open_clip", "avalanche.benchmarks")],
              "hook_left": any(isinstance(f, compat.TorchvisionShim) for f in sys.meta_path)}))
    """)
    # `import editkit` imports neither; the first torchvision import ran the shim (or found it not needed)
    assert out["before"] == [False, False]
    assert out["calls"] == [False, False]
    assert all(out["modules"])
    assert not out["hook_left"]


def test_plain_torchvision_import_matches_extension_status():
    out = run_python(LOAD_STANDALONE + """
loads = compat._extension_loads(tv_spec.submodule_search_locations[0])
try:
    import torchvision
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"loads": loads, "error": error, "editkit": "editkit" in sys.modules}))
""")
    assert out["editkit"] is False
    if out["loads"]:
        assert out["error"] is None
    else:  # this machine: CUDA torchvision next to CPU torch
        assert out["error"] is not None and "torchvision::nms does not exist" in out["error"]


def test_shim_is_idempotent_and_sufficient():
    out = run_python(LOAD_STANDALONE + """
loads = compat._extension_loads(tv_spec.submodule_search_locations[0])
first = compat.ensure_torchvision_importable()
library = compat._library
second = compat.ensure_torchvision_importable()
same_library = compat._library is library
import torchvision, torchvision.transforms
third = compat.ensure_torchvision_importable()
print(json.dumps({"loads": loads, "calls": [first, second, third], "same_library": same_library,
                  "nms_schema": compat._op_exists("torchvision::nms"), "qnms_schema": compat._op_exists("torchvision::qnms")}))
""")
    assert out["calls"][1:] == [False, False]
    assert out["same_library"]
    assert out["calls"][0] is (not out["loads"])  # installed exactly when the extension cannot load
    assert out["nms_schema"] and out["qnms_schema"]


def test_in_process_call_is_a_no_op():
    import editkit  # noqa: F401  (installs the import hook)
    import torchvision  # noqa: F401  (runs the shim, if this process had not imported torchvision yet)
    from editkit import _compat

    assert _compat.ensure_torchvision_importable() is False
    assert _compat.ensure_torchvision_importable() is False
    import torchvision.transforms

    assert torchvision.transforms.ToTensor is not None


def test_avalanche_import_does_not_warn_about_qp_solvers():
    """qpsolvers (pulled in by avalanche, unused by editkit) warns on import; users should not see it."""
    out = run_python("""
        import json, warnings
        import editkit
        from editkit.integrations.avalanche.benchmark import import_avalanche
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            functions = import_avalanche()
        print(json.dumps({"messages": [str(w.message) for w in caught], "callable": all(map(callable, functions))}))
    """)
    assert out["callable"]
    assert not [m for m in out["messages"] if "QP solver" in m], out["messages"]
