"""An exported model checked and timed as its user would run it: in a process that never imports editkit.

For a bank of a scenario (default: the one ``editkit stream`` writes for ``offline-vision``), the script

1. writes ``editkit add --all --out DIR`` (the merged model at alpha = 1, every task's head), as the command does;
2. hands each task's whole test split to a fresh Python process that imports torch alone (and transformers'
   tokenizer for text: texts are tokenized there, by the tokenizer saved in DIR): it loads ``DIR/model.pt2`` with
   ``torch.export.load``, counts each task's correct predictions and returns the logits;
3. compares: each task's accuracy with the one ``editkit add`` reported (the same count of correct examples, so
   the same printed digits), the logits with editkit's own to 1e-5;
4. reports the cost: the program's size, its load time, and inference milliseconds per example in that process,
   beside theta_0's plain forward: the program of f(x; theta_0) with the same heads, written the same way and
   timed in the same process on the same batches (both alternate, after a warm-up call each);
5. does steps 2-4 again for ``DIR/model.onnx`` in a process that imports onnxruntime and numpy alone (the inputs
   made by this process: pixels, or the texts tokenized by the saved tokenizer and padded per batch, as numpy
   arrays): each task's accuracy against the reported one, the logits against editkit's own, the file's size and
   ONNX Runtime's milliseconds per example on the same batch. Where ``--out`` refused ``model.onnx`` (ONNX
   Runtime's logits beyond the tolerance), the refused conversion is made again into a scratch directory and
   measured the same way (``unkept_onnx``): what the refusal kept from the user, in accuracy.

    python benchmarks/export_check.py [--scenario offline-vision] [--bank banks/offline-vision-taujp]
                                      [--out runs/export-check/model] [--json runs/export-check/report.json]

``--family clip|torchvision`` measures step 4 alone for a family no embedded scenario uses, at its usual size with
random weights (open_clip ViT-B-32 at 224 px; torchvision ResNet-18 at 224 px), a random taujp vector over every
parameter and a 10-class head: what the program costs does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Mapping

from editkit._compat import STANDALONE_SHIM

#: Examples per program call, in both processes.
BATCH = 64
#: Timed calls of each program in the cost measurement (after one warm-up call each).
TIMED = 10

#: The user's process: torch (and transformers' tokenizer for text) only. Only this workplace's CUDA build of
#: torchvision beside CPU torch needs its two op schemas declared to import, which transformers' tokenizer module
#: can trigger (``editkit._compat.STANDALONE_SHIM``, pasted in: the process never imports editkit); users with a
#: matching torch / torchvision pair need nothing (docs/troubleshooting.md).
PLAIN = STANDALONE_SHIM + textwrap.dedent("""
    import json, time
    directory, payload_path, logits_path, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    baseline_path, timed = sys.argv[5], int(sys.argv[6])
    manifest = json.load(open(f"{directory}/editkit.json"))
    spec = manifest["input"]
    started = time.perf_counter()
    model = torch.export.load(f"{directory}/{manifest['program']['file']}").module()
    load_seconds = time.perf_counter() - started
    payload = torch.load(payload_path)
    tokenizer = None
    if spec["kind"] == "text":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(f"{directory}/{spec['tokenizer']}")

    def inputs(task, start, stop):
        data = payload[task]
        if tokenizer is None:
            return (data["pixels"][start:stop],)
        ids = tokenizer(data["texts"][start:stop], truncation=True, max_length=data["max_length"],
                        add_special_tokens=True)["input_ids"]
        width = max(map(len, ids))
        padded = torch.full((len(ids), width), spec["pad_id"], dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, sequence in enumerate(ids):
            padded[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        return padded, mask

    out, logits = {}, {}
    with torch.inference_mode():
        for task, data in payload.items():
            labels = data["labels"]
            rows = [model(*inputs(task, start, start + batch))[task] for start in range(0, len(labels), batch)]
            logits[task] = torch.cat(rows)
            out[task] = {"correct": int((logits[task].argmax(dim=1) == labels).sum()), "total": len(labels)}
        runs = {"program": model}
        if baseline_path != "-":
            runs["baseline"] = torch.export.load(baseline_path).module()
        example = inputs(next(iter(payload)), 0, batch)
        seconds = dict.fromkeys(runs, 0.0)
        for run in runs.values():
            run(*example)  # warm-up: one-time costs of a first call
        for _ in range(timed):
            for name, run in runs.items():
                began = time.perf_counter()
                run(*example)
                seconds[name] += time.perf_counter() - began
    per_example = {name: 1000 * value / (max(timed, 1) * len(example[0])) for name, value in seconds.items()}
    torch.save(logits, logits_path)
    print(json.dumps({"tasks": out, "load_seconds": load_seconds, "ms_per_example": per_example["program"],
                      "baseline_ms_per_example": per_example.get("baseline"),
                      "editkit_imported": any(m == "editkit" or m.startswith("editkit.") for m in sys.modules)}))
""")


#: The ONNX user's process: onnxruntime and numpy only; the inputs come as numpy arrays, batch by batch.
ONNX_PLAIN = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import onnxruntime
    directory, batches_path, logits_path, timed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    manifest = json.load(open(f"{directory}/editkit.json"))
    started = time.perf_counter()
    session = onnxruntime.InferenceSession(f"{directory}/{manifest['onnx']['file']}")
    load_seconds = time.perf_counter() - started
    names = [i.name for i in session.get_inputs()]
    arrays = np.load(batches_path)
    tasks = [t["name"] for t in manifest["tasks"] if f"{t['name']}/labels" in arrays]
    out, logits = {}, {}
    for task in tasks:
        count = len([k for k in arrays if k.startswith(f"{task}/") and k.endswith(f"/{names[0]}")])
        rows = [session.run([task], {n: arrays[f"{task}/{i}/{n}"] for n in names})[0] for i in range(count)]
        logits[task] = np.concatenate(rows)
        labels = arrays[f"{task}/labels"]
        out[task] = {"correct": int((logits[task].argmax(axis=1) == labels).sum()), "total": len(labels)}
    example = {n: arrays[f"{tasks[0]}/0/{n}"] for n in names}
    session.run(None, example)  # warm-up
    began = time.perf_counter()
    for _ in range(timed):
        session.run(None, example)
    seconds = time.perf_counter() - began
    np.savez(logits_path, **logits)
    print(json.dumps({"tasks": out, "load_seconds": load_seconds,
                      "ms_per_example": 1000 * seconds / (max(timed, 1) * len(example[names[0]])),
                      "threads": session.get_session_options().intra_op_num_threads,
                      "others_imported": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "editkit"})}))
""")


def payload(built: Any, tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Each task's whole test split as the user's process reads it: pixels as the program takes them, or the raw
    texts with the length they were cut at; and the labels."""
    import torch

    backbone, data = built.backbone, {}
    for task in tasks:
        test = built.task(task).test
        labels = torch.as_tensor([int(test[i][1]) for i in range(len(test))])
        texts = getattr(test, "texts", None)
        if texts is not None:
            data[task] = {"texts": list(texts), "max_length": test.max_length, "labels": labels}
        else:
            data[task] = {"pixels": backbone.program_batch(test, range(len(test)))[0], "labels": labels}
    return data


def run_plain(directory: Path, data: Mapping[str, Any], baseline: Path | None = None, *, batch: int = BATCH,
              timed: int = TIMED) -> tuple[dict[str, Any], dict]:
    """(what the user's process measured, its logits per task) for the export in ``directory``; ``baseline``: a
    program of theta_0's plain forward, timed beside it (:func:`baseline_program`; None: no timing)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="editkit-export-check-") as scratch:
        payload_path, logits_path = Path(scratch) / "payload.pt", Path(scratch) / "logits.pt"
        torch.save(dict(data), payload_path)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", PLAIN, str(Path(directory).resolve()), str(payload_path),
                               str(logits_path), str(batch), str(Path(baseline).resolve()) if baseline else "-",
                               str(timed if baseline else 0)], env=env,
                              capture_output=True, text=True, timeout=1800, cwd=scratch)
        if done.returncode != 0:
            raise RuntimeError(f"the plain process failed:\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(logits_path)


def onnx_batches(directory: Path, data: Mapping[str, Any], batch: int = BATCH) -> dict[str, Any]:
    """:func:`payload`'s inputs as the ONNX process reads them: ``<task>/<batch>/<input>`` numpy arrays (texts
    tokenized by the tokenizer saved in ``directory`` and padded on the right per batch) and ``<task>/labels``."""
    import torch

    manifest = json.loads((Path(directory) / "editkit.json").read_text())
    spec, names = manifest["input"], manifest["onnx"]["inputs"]
    tokenizer = None
    if spec["kind"] == "text":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(Path(directory) / spec["tokenizer"]))
    arrays = {}
    for task, data_of_task in data.items():
        arrays[f"{task}/labels"] = data_of_task["labels"].numpy()
        for index, start in enumerate(range(0, len(data_of_task["labels"]), batch)):
            if tokenizer is None:
                inputs = (data_of_task["pixels"][start:start + batch],)
            else:
                from editkit.models.inputs import pad_right

                ids = tokenizer(data_of_task["texts"][start:start + batch], truncation=True,
                                max_length=data_of_task["max_length"], add_special_tokens=True)["input_ids"]
                inputs = pad_right([torch.tensor(i, dtype=torch.long) for i in ids], spec["pad_id"])
            arrays.update({f"{task}/{index}/{name}": value.numpy() for name, value in zip(names, inputs)})
    return arrays


def run_onnx(directory: Path, data: Mapping[str, Any], *, batch: int = BATCH, timed: int = TIMED
             ) -> tuple[dict[str, Any], dict]:
    """(what the ONNX process measured, its logits per task) for ``directory/model.onnx``."""
    import numpy as np
    import torch

    with tempfile.TemporaryDirectory(prefix="editkit-onnx-check-") as scratch:
        batches_path, logits_path = Path(scratch) / "batches.npz", Path(scratch) / "logits.npz"
        np.savez(batches_path, **onnx_batches(directory, data, batch))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", ONNX_PLAIN, str(Path(directory).resolve()), str(batches_path),
                               str(logits_path), str(timed)], env=env, capture_output=True, text=True, timeout=1800,
                              cwd=scratch)
        if done.returncode != 0:
            raise RuntimeError(f"the ONNX process failed:\n{done.stderr}")
        with np.load(logits_path) as logits:
            return json.loads(done.stdout.strip().splitlines()[-1]), {k: torch.from_numpy(logits[k]) for k in logits}


def editkit_logits(built: Any, vector: Any, tasks: list[str], batch: int = BATCH) -> dict:
    """editkit's own logits of the edited model (the task model the scorer builds) on each task's test split."""
    import torch

    from editkit.core.linearize import build_task_model

    backbone = built.backbone
    model = build_task_model(backbone.module, vector.mode, names=list(vector.tensors), vector_mode=vector.mode)
    model.load_task_vector(vector.tensors)
    model.eval()
    logits = {}
    with torch.no_grad():
        for task in tasks:
            test, rows = built.task(task).test, []
            for start in range(0, len(test), batch):
                items = [test[i][0] for i in range(start, min(start + batch, len(test)))]
                features = backbone.batching.run(model, backbone.batching.collate(items))
                rows.append(built.heads[task](features.float()))
            logits[task] = torch.cat(rows)
    return logits


def baseline_program(built: Any, tasks: list[str], path: Path) -> Path:
    """The program of theta_0's plain forward f(x; theta_0) with the same heads, written as ``--out`` writes one."""
    import torch

    from editkit.merge.arithmetic import TaskVector
    from editkit.io.layout import quiet_export
    from editkit.io.program import trace

    program, _ = trace(built.backbone, TaskVector({}, "nonlinear"), {task: built.heads[task] for task in tasks})
    with quiet_export():
        torch.export.save(program, path)
    return path


def check(bank_dir: Path, out: Path) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for the bank in ``bank_dir``."""
    import torch

    from editkit.bank.store import open_bank
    from editkit.runs.edit import add
    from editkit.runs.export import export_edit

    bank = open_bank(bank_dir)
    result = add(bank, bank.names(), weights_scores=True)
    export_edit(result, bank, out, force=True)
    tasks = list(result.report["per_task"])
    data = payload(result.built, tasks)
    with tempfile.TemporaryDirectory(prefix="editkit-baseline-") as scratch:
        plain, logits = run_plain(out, data, baseline_program(result.built, tasks, Path(scratch) / "theta0.pt2"))
    own = editkit_logits(result.built, result.vector, tasks)
    rows = {}
    for task in tasks:
        counted = plain["tasks"][task]
        reported = result.report["per_task"][task]
        rows[task] = {"reported": reported, "program": counted["correct"] / counted["total"],
                      "max_abs_logit_difference": float((logits[task] - own[task]).abs().max())}
    size = (out / "model.pt2").stat().st_size
    report = {"scenario": result.report["scenario"], "mode": result.mode, "tasks": rows,
              "same_accuracy": all(r["reported"] == r["program"] for r in rows.values()),
              "max_abs_logit_difference": max(r["max_abs_logit_difference"] for r in rows.values()),
              "editkit_imported": plain["editkit_imported"], "program_mb": size / 2**20,
              "load_seconds": plain["load_seconds"], "program_ms_per_example": plain["ms_per_example"],
              "plain_ms_per_example": plain["baseline_ms_per_example"], "threads": torch.get_num_threads()}
    report["program_over_plain"] = report["program_ms_per_example"] / report["plain_ms_per_example"]
    report["onnx"] = onnx_check(out, data, own, rows, report["plain_ms_per_example"], result.built, result.vector)
    return report


def onnx_check(out: Path, data: Mapping[str, Any], own: Mapping[str, Any], rows: Mapping[str, dict],
               plain_ms: float, built: Any, vector: Any) -> dict[str, Any]:
    """Step 5 (see the module docstring): each task's ``onnx`` accuracy and logit difference added to ``rows``;
    the file's size and cost. Where ``--out`` wrote no ``model.onnx`` (its check refused it), why, and the same
    measurement of the file it refused (``unkept_onnx`` in the rows): how far from the report it would have been."""
    written = json.loads((out / "editkit.json").read_text())["onnx"]
    if "skipped" not in written:
        return measure_onnx(out, data, own, rows, plain_ms, "onnx")
    with tempfile.TemporaryDirectory(prefix="editkit-unkept-onnx-") as scratch:
        unkept = unkept_onnx(out, Path(scratch), built, vector, list(rows))
        return {"skipped": written["skipped"], "unkept": measure_onnx(unkept, data, own, rows, plain_ms, "unkept_onnx")}


def unkept_onnx(out: Path, scratch: Path, built: Any, vector: Any, tasks: list[str]) -> Path:
    """The conversion ``--out`` made and refused, made again into ``scratch`` without the check, beside a copy of
    the export's manifest naming it and links to the export's other files (a text model's tokenizer): a directory
    :func:`run_onnx` reads."""
    from editkit.io.onnx import convert
    from editkit.io.program import trace

    for entry in out.iterdir():
        if entry.name != "editkit.json":
            (scratch / entry.name).symlink_to(entry.resolve())
    program, inputs = trace(built.backbone, vector, {task: built.heads[task] for task in tasks})
    manifest = json.loads((out / "editkit.json").read_text())
    manifest["onnx"] = convert(program, inputs.spec["names"], tasks, scratch / "model.onnx", inputs.dynamic)
    (scratch / "editkit.json").write_text(json.dumps(manifest))
    return scratch


def measure_onnx(directory: Path, data: Mapping[str, Any], own: Mapping[str, Any], rows: Mapping[str, dict],
                 plain_ms: float, key: str) -> dict[str, Any]:
    """``directory/model.onnx`` run in the ONNX process: each task's accuracy and logit difference added to
    ``rows`` under ``key``; the file's size, load time and cost."""
    measured, logits = run_onnx(directory, data)
    for task, row in rows.items():
        counted = measured["tasks"][task]
        row[key] = counted["correct"] / counted["total"]
        row[f"{key}_max_abs_logit_difference"] = float((logits[task] - own[task]).abs().max())
    return {"same_accuracy": all(r["reported"] == r[key] for r in rows.values()),
            "max_abs_logit_difference": max(r[f"{key}_max_abs_logit_difference"] for r in rows.values()),
            "process_imported": measured["others_imported"], "mb": (directory / "model.onnx").stat().st_size / 2**20,
            "load_seconds": measured["load_seconds"], "ms_per_example": measured["ms_per_example"],
            "over_plain": measured["ms_per_example"] / plain_ms, "threads": measured["threads"]}


#: ``--family``: the scenario text of a backbone at its usual size, random weights (see the module docstring).
FAMILIES = {
    "clip": 'family = "clip"\nmodel = "ViT-B-32"\npretrained = "random"',
    "torchvision": 'family = "torchvision"\nmodel = "resnet18"\nweights = "random"\nimage_size = 224',
}


def family_cost(family: str, out: Path) -> dict[str, Any]:
    """Step 4 for a backbone family at its usual size (see the module docstring)."""
    import torch

    from editkit.merge.arithmetic import TaskVector
    from editkit.models.heads import LinearHead
    from editkit.io.layout import PROGRAM_FILE, quiet_export
    from editkit.io.program import trace
    from editkit.scenario.build import build_backbone
    import tomllib

    from editkit.scenario.spec import parse_scenario

    spec = parse_scenario(tomllib.loads(f'name = "cost"\n[backbone]\n{FAMILIES[family]}\n[heads]\nkind = "probe"\n'
                                        '[[tasks]]\nname = "task"\nsource = "packaged:digits"\n'))
    backbone = build_backbone(spec)
    generator = torch.Generator().manual_seed(0)
    delta = {n: 1e-3 * torch.randn(p.shape, generator=generator) for n, p in backbone.module.named_parameters()}
    head = LinearHead(torch.randn(10, backbone.feature_dim, generator=generator), torch.zeros(10))
    out.mkdir(parents=True, exist_ok=True)
    for name, vector in (("model", TaskVector(delta, "taujp")), ("theta0", TaskVector({}, "nonlinear"))):
        program, inputs = trace(backbone, vector, {"task": head})
        with quiet_export():
            torch.export.save(program, out / f"{name}.pt2")
    manifest = {"program": {"file": "model.pt2"}, "input": inputs.spec}
    (out / "editkit.json").write_text(json.dumps(manifest))
    height, width = inputs.spec["size"]
    data = {"task": {"pixels": torch.randn(BATCH, 3, height, width, generator=generator),
                     "labels": torch.zeros(BATCH, dtype=torch.long)}}
    plain, _ = run_plain(out, data, out / "theta0.pt2")
    report = {"family": family, "backbone": backbone.name, "program_mb": (out / PROGRAM_FILE).stat().st_size / 2**20,
              "load_seconds": plain["load_seconds"], "program_ms_per_example": plain["ms_per_example"],
              "plain_ms_per_example": plain["baseline_ms_per_example"], "threads": torch.get_num_threads()}
    report["program_over_plain"] = report["program_ms_per_example"] / report["plain_ms_per_example"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="offline-vision")
    parser.add_argument("--bank", type=Path, default=None, help="default banks/<scenario>-taujp")
    parser.add_argument("--out", type=Path, default=None, help="default runs/export-check/<scenario>")
    parser.add_argument("--family", choices=sorted(FAMILIES), default=None,
                        help="measure the cost alone for this family at its usual size (random weights)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.family:
        report = family_cost(args.family, args.out or Path("runs") / "export-check" / args.family)
    else:
        bank = args.bank or Path("banks") / f"{args.scenario}-taujp"
        report = check(bank, args.out or Path("runs") / "export-check" / args.scenario)
        for task, row in report["tasks"].items():
            print(f"{task:>14}: reported {100 * row['reported']:.1f}, program {100 * row['program']:.1f}, "
                  f"max |logit difference| {row['max_abs_logit_difference']:.2g}")
            for key, what in (("onnx", "ONNX Runtime"), ("unkept_onnx", "ONNX Runtime, the refused file")):
                if key in row:
                    print(f"{'':>14}  {what} {100 * row[key]:.1f}, max |logit difference| "
                          f"{row[f'{key}_max_abs_logit_difference']:.2g}")
        print(f"same accuracy on every task: {report['same_accuracy']}; editkit imported by the user's process: "
              f"{report['editkit_imported']}")
        onnx = report["onnx"]
        if "skipped" in onnx:
            print(onnx["skipped"])
        for name, measured in (("model.onnx", onnx), ("the refused model.onnx", onnx.get("unkept"))):
            if measured is not None and "skipped" not in measured:
                print(f"{name}: same accuracy on every task: {measured['same_accuracy']}; torch or editkit imported "
                      f"by its process: {measured['process_imported'] or 'none'}; {measured['mb']:.1f} MiB, loaded in "
                      f"{measured['load_seconds']:.2f} s; {measured['ms_per_example']:.2f} ms/example "
                      f"({measured['over_plain']:.2f}x theta_0's program)")
    print(f"program {report['program_mb']:.1f} MiB, loaded in {report['load_seconds']:.2f} s; "
          f"{report['program_ms_per_example']:.2f} ms/example against theta_0's plain forward "
          f"{report['plain_ms_per_example']:.2f} ms/example ({report['program_over_plain']:.2f}x), "
          f"{report['threads']} threads")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
