"""A causal LM written by ``--out``, read back by plain transformers in a process that never imports editkit:
the perplexities of given token blocks, computed there by hand from the logits; and the small rude-text
scenario the export tests write models of."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from editkit._compat import STANDALONE_SHIM
from editkit.data.text import pack
from helpers.cli import invoke
from helpers.models import char_tokenizer
from helpers.scenarios import write_language_scenario
from helpers.text import CLEAN, RUDE, registered_bang_scorer, registered_corpora


#: A process without editkit. Only this machine's CUDA build of torchvision next to CPU torch needs help to
#: import (``editkit._compat.STANDALONE_SHIM``, docs/troubleshooting.md, "Notes on this environment"): its two op
#: schemas, declared with plain torch.
HAND_PERPLEXITY = STANDALONE_SHIM + textwrap.dedent("""
    import json, math
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


MAX_LENGTH, EVAL_BLOCKS = 16, 3
PROMPTS = {"train": ["so then"], "val": ["you are", "he said"], "test": ["well, you", "she told him", "and then"]}


@contextlib.contextmanager
def rude_scenario(root: Path, prefix: str, backbone: dict | None = None) -> Iterator[tuple[Path, Path]]:
    """A two-block random Llama and its rude-text scenario ``<prefix>-rude`` (the last block, 3 taujp steps at lr
    1e-2; a negation over alphas 1 and 2 of 3 short samples, scored by the "!" scorer), whose corpora and scorer
    are registered inside the block; ``backbone`` adds ``[backbone]`` options. Yields (scenario file, checkpoint
    directory)."""
    corpora = {f"{prefix}-rude": RUDE, f"{prefix}-clean": CLEAN, f"{prefix}-prompts": PROMPTS}
    path, model_dir = write_language_scenario(
        root, f"{prefix}-rude", task_corpus=f"{prefix}-rude", control=f"{prefix}-clean", prompts=f"{prefix}-prompts",
        scorer=f"{prefix}-bang", max_length=MAX_LENGTH, eval_blocks=EVAL_BLOCKS, steps=3, lr=1e-2,
        negation={"alphas": [1.0, 2.0], "samples": 3, "max_new_tokens": 4, "eval_blocks": EVAL_BLOCKS,
                  "batch_size": 2}, backbone=backbone)
    with registered_bang_scorer(f"{prefix}-bang"), registered_corpora(corpora):
        yield path, model_dir


def held_out_blocks() -> dict[str, list[list[int]]]:
    """The rude (target) and clean (control) test texts as the scenario packs them, token ids."""
    tokenizer = char_tokenizer()
    return {"target": [b.tolist() for b in pack(tokenizer, RUDE["test"], MAX_LENGTH, limit=EVAL_BLOCKS)],
            "control": [b.tolist() for b in pack(tokenizer, CLEAN["test"], MAX_LENGTH, limit=EVAL_BLOCKS)]}


def negated_out_matches_report(bank: Path, run_dir: Path, out: Path, alpha: float = 2.0) -> dict:
    """``editkit negate rude --alpha A --out OUT``; asserts that plain transformers' hand perplexities of the
    held-out blocks under the written model are the ones the report gives its row, and returns that row."""
    result = invoke("negate", "rude", "--bank", bank, "--alpha", alpha, "--run-dir", run_dir, "--out", out)
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads((run_dir / "report.json").read_text())["rows"] if r["alpha"] == alpha)
    hand = plain_transformers(out, held_out_blocks())
    assert hand["target"] == pytest.approx(row["target"], rel=1e-5)
    assert hand["control"] == pytest.approx(row["control"], rel=1e-5)
    return row
