"""A causal LM written by ``--out``, read back by plain transformers in a process that never imports editkit:
the perplexities of given token blocks, computed there by hand from the logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


#: A process without editkit. Only this machine's CUDA build of torchvision next to CPU torch needs help to
#: import (what ``editkit._compat`` does, docs/troubleshooting.md, "Notes on this environment"): its two op schemas, plain torch.
HAND_PERPLEXITY = textwrap.dedent("""
    import json, math, sys
    import torch
    try:
        import torchvision  # noqa: F401
    except RuntimeError:
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, blocks = sys.argv[1], json.loads(sys.argv[2])
    lm = AutoModelForCausalLM.from_pretrained(directory).eval()
    AutoTokenizer.from_pretrained(directory)
    out = {}
    for role, rows in blocks.items():
        nll, count = 0.0, 0
        with torch.no_grad():
            for row in rows:
                logp = torch.log_softmax(lm(input_ids=torch.tensor([row])).logits[0].double(), dim=-1)
                for t in range(len(row) - 1):
                    if row[t] != lm.config.eos_token_id:  # the first token of the next packed text is no target
                        nll -= float(logp[t, row[t + 1]])
                        count += 1
        out[role] = math.exp(nll / count)
    out["editkit_imported"] = any(name == "editkit" or name.startswith("editkit.") for name in sys.modules)
    out["generation_config"] = lm.generation_config is not None
    print(json.dumps(out))
""")


def plain_transformers(directory: Path, blocks: dict[str, list[list[int]]]) -> dict:
    """The hand perplexities of ``blocks`` under the model in ``directory``, in a process without editkit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", HAND_PERPLEXITY, str(directory), json.dumps(blocks)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(directory.parent))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
