"""`editkit bench`: coefficient search, exact evaluation from tangents, refusals, and an end-to-end CLI run.

The end-to-end run uses the real offline-vision ingredients (EfficientNet-Lite0 with its
pip-shipped weights, packaged datasets from the editkit cache) reduced to two tasks with
small splits and 3 optimizer steps, on one torch thread (the test machine is shared),
so every stage runs: streams for the three modes ->
banks -> coefficient search -> negation -> tauJp / xi diagnostics -> cost -> report + PNGs.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from editkit.cli import app
from editkit.scenario import build as scenario_mod, spec as scenario_spec
from editkit.models.backbone import state_fingerprint
from editkit.bank.store import Bank
from editkit.runs.bench.claims import verdict
from editkit.runs.bench.config import BenchConfig, parse_names
from editkit.runs.bench.run import run_bench
from editkit.merge.coefficients import alpha_grid, search_alpha, select_alpha, select_negation_alpha
from editkit.eval.diagnostics import taujp_matrix
from editkit.errors import ConfigError
from editkit.eval.accuracy import ClassificationScorer, evaluate_vector
from editkit.models.heads import LinearHead
from editkit.util.progress import NullProgress
from editkit.eval.features import EVAL_BATCH_SIZE
from editkit.eval.sweep import ModeEvaluator, SharedModels, TaskSplits
from editkit.data.tasks import TaskData, TensorTaskDataset
from editkit.train.recipe import Recipe, attach_adapter

from helpers import models
from helpers.scenarios import write_scenario

runner = CliRunner()
STEPS = 3
GRID = 3
TASKS = ["digits", "mnist"]
N_TEST = 50


# --- coefficient search -----------------------------------------------------------------------


def test_alpha_grid_is_the_papers_linspace():
    grid = alpha_grid(21)
    assert len(grid) == 21 and grid[0] == 0.0 and grid[-1] == 1.0
    assert grid[7] == pytest.approx(0.35)
    assert alpha_grid(3) == [0.0, 0.5, 1.0]
    assert alpha_grid(5, top=2.0) == [0.0, 0.5, 1.0, 1.5, 2.0]
    for bad in (0, 1, -3):
        with pytest.raises(ConfigError):
            alpha_grid(bad)
    for top in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="top"):
            alpha_grid(5, top=top)


def test_search_picks_the_argmax_of_a_synthetic_validation_curve():
    grid = alpha_grid(21)
    calls = []

    def curve(a: float) -> float:  # peak at 0.35, on the grid
        calls.append(a)
        return 0.9 - (a - 0.35) ** 2

    best, scores = search_alpha(grid, curve)
    assert best == pytest.approx(0.35)
    assert calls == grid and len(scores) == 21
    # off-grid peak: the nearest grid point wins
    assert search_alpha(grid, lambda a: -abs(a - 0.62))[0] == pytest.approx(0.6)
    # equal bests: the smallest alpha
    assert select_alpha([0.0, 0.5, 1.0], [0.3, 0.8, 0.8]) == 1


def test_negation_alpha_minimises_target_subject_to_control():
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    targets = [0.9, 0.6, 0.3, 0.1, 0.05]
    controls = [0.80, 0.79, 0.77, 0.74, 0.60]
    # control_0 = 0.8 -> floor 0.76: alphas 0, 0.25, 0.5 are feasible; 0.5 has the lowest target
    assert select_negation_alpha(alphas, targets, controls, 0.8) == 2
    # floor 0.72: alpha 0.75 (control 0.74) becomes feasible and has the lowest target
    assert select_negation_alpha(alphas, targets, controls, 0.8, retain=0.9) == 3
    # equal targets: the higher control, then the smaller alpha
    assert select_negation_alpha([0.0, 0.5, 1.0], [0.2, 0.1, 0.1], [0.8, 0.7, 0.78], 0.8) == 2
    assert select_negation_alpha([0.0, 0.5, 1.0], [0.2, 0.1, 0.1], [0.8, 0.78, 0.78], 0.8) == 1
    assert select_negation_alpha([0.5, 1.0], [0.2, 0.1], [0.1, 0.1], 0.8) is None


def test_parse_names_refuses_unknown_repeated_and_empty():
    assert parse_names("linear, taujp", ("nonlinear", "linear", "taujp"), "modes") == ("linear", "taujp")
    for bad in ("lienar", "linear,linear", " , "):
        with pytest.raises(ConfigError):
            parse_names(bad, ("nonlinear", "linear", "taujp"), "modes")
    with pytest.raises(ConfigError, match="empty"):
        BenchConfig(alphas=[]).validated()
    with pytest.raises(ConfigError, match=r"^bench\.control = 'imagenett' is not one of auto, tasks, imagenet$"):
        BenchConfig(control="imagenett").validated()


# --- exact evaluation from cached tangents ----------------------------------------------------


class ItemsOnly(torch.utils.data.Dataset):
    """A dataset that only answers ``len`` and ``[i]``, as file-backed datasets do (no ``.inputs``)."""

    def __init__(self, inner: TensorTaskDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]


def tiny_setup(tmp_path: Path, mode: str, items_only: bool = False, adapter: bool = False):
    """Two tasks and a bank of two random vectors; with ``adapter`` a rank-2 LoRA (alpha 3) on the MLP and
    vectors of its factors (plain LoRA in ``nonlinear`` mode)."""
    module = models.mlp(6, 8, 5, seed=0)
    recipe = Recipe(adapter="lora", lora_rank=2, lora_alpha=3.0) if adapter else Recipe()
    attach_adapter(module, [recipe])
    tasks, heads = [], {}
    for name in ("a", "b"):
        def split(n: int):
            data = TensorTaskDataset(torch.randn(n, 6), torch.randint(0, 3, (n,)))
            return ItemsOnly(data) if items_only else data

        tasks.append(TaskData(name, ["0", "1", "2"], split(20), split(9), split(11)))
        heads[name] = LinearHead(torch.randn(3, 5), torch.randn(3))
    base = state_fingerprint(module.state_dict())
    bank = Bank(tmp_path / f"bank-{mode}-{items_only}")
    vectors = {}
    for name in ("a", "b"):
        vectors[name] = {n: 0.5 * torch.randn_like(p) for n, p in module.named_parameters()
                         if not adapter or ".lora_" in n}
        bank.append(name, vectors[name], task=name, mode=mode, base=base, recipe=recipe.to_dict())
    data = TaskSplits(module, tasks, batch_size=4, xi_samples=5, progress=NullProgress())
    ev = ModeEvaluator(mode, bank, {"a": "a", "b": "b"}, data, heads, base, SharedModels.of(module))
    return module, tasks, heads, vectors, ev


def weight_updates(vector: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain-LoRA vector's updates s B A per adapted weight, by hand."""
    return {a.replace("lora_A.default", "base_layer"): scaling * vector[a.replace("lora_A", "lora_B")] @ vector[a]
            for a in vector if ".lora_A." in a}


@pytest.mark.parametrize("mode, adapter", [("linear", False), ("nonlinear", False), ("linear", True),
                                           ("nonlinear", True)])
def test_mode_evaluator_matches_evaluate_vector_for_every_coefficient(tmp_path, mode, adapter):
    """Plain-LoRA vectors combine as weight updates (their factors do not add): against sums of s B A by hand."""
    module, tasks, heads, vectors, ev = tiny_setup(tmp_path, mode, adapter=adapter)
    if adapter and mode == "nonlinear":
        vectors = {name: weight_updates(v, 1.5) for name, v in vectors.items()}
    if ev.linearized:
        ev.compute_tangents(["a", "b"])
    for split in ("val", "test"):
        evals = [ClassificationScorer(t.name, heads[t.name], getattr(t, split)) for t in tasks]
        for combo in ({"a": 1.0, "b": 1.0}, {"a": 0.35, "b": 0.35}, {"a": -0.7}, {"b": 2.0}, {}):
            tau = {k: sum(c * vectors[v][k] for v, c in combo.items()) for k in vectors["a"]} if combo else None
            expected = evaluate_vector(module, mode, tau, evals, batch_size=4)
            assert ev.accuracies(combo, split, ["a", "b"]) == pytest.approx(expected, abs=1e-12)
    # the features themselves: theta_0's plus the combined tangents equal the linearized forward
    if ev.linearized:
        model = SharedModels.of(module).holding({k: 0.3 * vectors["a"][k] - 1.2 * vectors["b"][k]
                                                 for k in vectors["a"]}, linearized=True)
        x = tasks[0].test.inputs
        with torch.no_grad():
            direct = model(x)
        combined = ev.data.f0["test"]["a"] + 0.3 * ev.tangents("a", "test")["a"] - 1.2 * ev.tangents("b", "test")["a"]
        torch.testing.assert_close(combined, direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_taujp_matrix_from_cached_tangents_equals_the_direct_one(tmp_path, mode):
    """The bench's matrix (cached tangents for linearized vectors, computed and dropped for non-linear ones)
    equals diagnostics.taujp_matrix, which test_diagnostics checks by hand and by finite differences."""
    module, tasks, _, vectors, ev = tiny_setup(tmp_path, mode)
    if ev.linearized:
        ev.compute_tangents(["a", "b"])
    rows = [ev.tangent_norm_means(a, ["a", "b"], "test") for a in ("a", "b")]
    got = np.array([[row[b] for b in ("a", "b")] for row in rows])
    want = taujp_matrix(module, [vectors["a"], vectors["b"]], [t.test.inputs for t in tasks], batch_size=4)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_adopted_tangents_are_not_computed_again_and_the_rest_are(tmp_path, monkeypatch):
    """A stream's tangents handed to the evaluator (here: vector a on task a's test split, marked so a recomputation
    would show) stay as given; compute_tangents runs one pass for each (vector, split, task) it lacks, and counts
    only those."""
    *_, ev = tiny_setup(tmp_path, "linear")
    marked = torch.full((len(ev.data.sets["test"]["a"]), 5), 7.0)
    ev.adopt_tangents("test", {"a": {"a": marked}})
    every = sum(ev.data.batches(s, n) for s in ("val", "test") for n in ("a", "b"))
    assert ev.tangent_batches(["a", "b"]) == 2 * every - ev.data.batches("test", "a")
    passes = []
    real = ev.data.map
    monkeypatch.setattr(ev.data, "map", lambda fn, split, name, bar=None: passes.append((split, name)) or
                        real(fn, split, name, bar))
    ev.compute_tangents(["a", "b"])
    assert sorted(passes) == sorted([("val", "a"), ("val", "b"), ("test", "b")] +
                                    [(s, n) for s in ("val", "test") for n in ("a", "b")])
    assert ev.tangents("a", "test")["a"] is marked and ev.tangent_batches(["a", "b"]) == 0
    with pytest.raises(ValueError, match="cover 3 inputs, not 11"):
        ev.adopt_tangents("test", {"b": {"a": marked[:3]}})


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_file_backed_splits_give_the_same_numbers_as_in_memory_ones(tmp_path, mode):
    """Datasets without an input tensor are streamed through a DataLoader: same labels, features, predictions."""
    *_, in_memory = tiny_setup(tmp_path, mode)
    *_, streamed = tiny_setup(tmp_path, mode, items_only=True)
    assert isinstance(streamed.data.sets["xi"]["a"], torch.utils.data.Subset)
    for ev in (in_memory, streamed):
        if ev.linearized:
            ev.compute_tangents(["a", "b"])
    for split in ("val", "test", "xi"):
        for name in ("a", "b"):
            assert torch.equal(streamed.data.labels[split][name], in_memory.data.labels[split][name])
            torch.testing.assert_close(streamed.data.f0[split][name], in_memory.data.f0[split][name])
        for combo in ({"a": 1.0, "b": 1.0}, {"a": -0.5}):
            got, want = streamed.predictions(combo, split, ["a", "b"]), in_memory.predictions(combo, split, ["a", "b"])
            assert all(torch.equal(got[t], want[t]) for t in ("a", "b"))
    assert len(streamed.data.labels["xi"]["a"]) == 5


# --- end to end through the CLI ---------------------------------------------------------------


def bench_args(scenario: Path, root: Path, *extra) -> list[str]:
    return ["bench", "--scenario", str(scenario), "--steps", str(STEPS), "--grid", str(GRID), "--negation-grid", "3",
            "--bank-root", str(root / "banks"), "--run-dir", str(root / "run"), "--xi-samples", "30", "--threads", "1",
            *map(str, extra)]


#: mode -> the tangents its evaluator took from the stream in the fixture's run: {vector: [tasks]}
ADOPTED: dict[str, dict[str, list[str]]] = {}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    scenario = write_scenario(root)
    adopt = ModeEvaluator.adopt_tangents

    def recording(ev, split, tangents):
        ADOPTED[ev.label] = {vector: sorted(scored) for vector, scored in tangents.items()}
        return adopt(ev, split, tangents)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModeEvaluator, "adopt_tangents", recording)
        result = runner.invoke(app, bench_args(scenario, root, "--log", "csv"))
    assert result.exit_code == 0, result.output
    report = json.loads((root / "run" / "report.json").read_text())
    return root, scenario, result.output, report


def bench_again(bench_run, run_dir: str, *extra) -> tuple[object, dict]:
    """The fixture's bench run again over its banks with ``extra`` options into ``<root>/<run_dir>``: (the CLI
    result, its report), the command having succeeded."""
    root, scenario, _, _ = bench_run
    args = bench_args(scenario, root, *extra)
    args[args.index("--run-dir") + 1] = str(root / run_dir)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result, json.loads((root / run_dir / "report.json").read_text())


def pct(v):
    return "—" if v is None else f"{100 * v:.1f}"


def table_rows(output: str) -> list[list[str]]:
    """Body rows of every rich table in the output, as stripped cells."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in output.splitlines() if line.count("│") >= 2]


@pytest.mark.slow
def test_addition_table_shape_and_numbers(bench_run):
    root, _, output, report = bench_run
    rows = report["addition"]["rows"]
    assert report["tasks"] == TASKS and report["addition"]["columns"] == TASKS + ["absolute", "normalized"]
    assert report["runtime"] == "cpu, fp32"  # recorded beside torch_threads: the numbers depend on both
    # pretrained + per mode: every merge method in registry order (1.0, tuned), then single-task
    methods = ["cart", "dare", "iso-c", "iso-cts", "magmax", "opcm", "task-arithmetic", "ties", "tsv"]
    assert len(rows) == 1 + 3 * (2 * len(methods) + 1)
    assert [(r["method"], r["coefficient"]) for r in rows[1:2 * len(methods) + 2]] == [
        (m, c) for m in methods for c in ("1.0", "tuned")] + [("single-task", None)]
    assert report["method_options"] == {"cart": {"rank_ratio": 0.12, "lam": 2.0},
                                        "dare": {"p": 0.9, "seed": 0, "base": "task-arithmetic"},
                                        "iso-c": {}, "iso-cts": {"common": 0.8}, "magmax": {},
                                        "opcm": {"share": 0.5}, "task-arithmetic": {}, "ties": {"k": 0.2}, "tsv": {}}
    grid = report["grid"]
    assert grid == [0.0, 0.5, 1.0]
    for row in rows:
        assert set(row["per_task"]) == set(TASKS)
        assert row["absolute"] == pytest.approx(np.mean([row["per_task"][t] for t in TASKS]))
        if row["coefficient"] == "tuned":
            search = report["alpha_search"][row["mode"]][row["method"]]
            assert row["alpha"] == search["chosen"] == grid[int(np.argmax(search["val_absolute"]))]
            assert row["val_absolute"] == pytest.approx(max(search["val_absolute"]))
        if row["method"] not in ("pretrained",):
            single = report["single_task"][row["mode"]]["test"]
            assert row["normalized"] == pytest.approx(np.mean([row["per_task"][t] / single[t] for t in TASKS]))
    # every addition row is printed exactly as report.json holds it
    printed = table_rows(output)
    for row in rows:
        cells = [pct(row["per_task"][t]) for t in TASKS] + [pct(row["absolute"]), pct(row["normalized"]),
                                                             pct(row["class_incremental"])]
        if row["class_incremental"] is not None:  # None: the single-task row, one model per task
            assert row["class_incremental"] == pytest.approx(np.mean(list(row["class_incremental_per_task"].values())))
        assert any(line[: 2] == [row["label"], row["mode"] or "—"] and line[3:] == cells for line in printed), row


@pytest.mark.slow
def test_every_printed_number_is_in_the_report(bench_run):
    _, _, output, report = bench_run
    known: set[str] = set()

    def collect(value):
        if isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            for fmt in (".0f", ".1f", ".2f", ".3f", "g"):
                known.add(format(value, fmt))
                known.add(format(100 * value, fmt))
            known.add(str(value))

    collect(report)
    for line in table_rows(output):
        for cell in line:
            for token in re.findall(r"-?\d+(?:\.\d+)?", cell):
                assert token in known, (token, line)


@pytest.mark.slow
def test_numbers_agree_with_the_streams_own_evaluation(bench_run):
    """Ground truth: the stream scored theta_0 + sum tau (alpha = 1) and each vector alone with evaluate_vector."""
    _, _, _, report = bench_run
    n_test = N_TEST
    for mode in ("nonlinear", "linear", "taujp"):
        last = report["streams"][mode]["steps"][-1]
        ta1 = next(r for r in report["addition"]["rows"]
                   if r["method"] == "task-arithmetic" and r["mode"] == mode and r["coefficient"] == "1.0")
        for t in TASKS:
            # linearized: f0 + sum J tau_i vs one jvp of the sum -> float rounding may flip an argmax
            tol = 0 if mode == "nonlinear" else 1.01 / n_test
            assert ta1["per_task"][t] == pytest.approx(last["merged"]["per_task"][t], abs=tol + 1e-12)
            step = next(s for s in report["streams"][mode]["steps"] if s["task"] == t)
            assert report["single_task"][mode]["test"][t] == pytest.approx(step["single_task"], abs=tol + 1e-12)
            assert report["pretrained"]["test"][t] == pytest.approx(step["pretrained"], abs=1.01 / n_test)


@pytest.mark.slow
def test_diagnostics_negation_and_cost(bench_run):
    _, _, output, report = bench_run
    taujp = report["taujp"]
    for mode in ("nonlinear", "linear", "taujp"):
        m = np.array(taujp["matrices"][mode])
        assert m.shape == (2, 2) and np.all(m >= 0)
    assert len(taujp["pairs"]) == 3 and taujp["correlation"]["n"] == 3
    xi = report["xi"]
    assert xi["pair"] == ["digits", "mnist"]
    for data in xi["modes"].values():
        values = np.array(data["xi"])
        assert values.shape == (len(xi["grid"]),) * 2
        assert np.all((values >= 0) & (values <= 2))
        zero = xi["grid"].index(0.0)
        # a1 = 0: task 1's model is theta_0 + a2 tau_2 either way; a2 = 0: likewise for task 0
        assert np.all(np.array(data["terms"][1])[zero, :] == 0.0) and np.all(np.array(data["terms"][0])[:, zero] == 0.0)
        assert values[zero, zero] == 0.0
    for mode, neg in report["negation"].items():
        assert [r["task"] for r in neg["rows"]] == TASKS
        for row in neg["rows"]:
            assert row["alpha1"]["alpha"] == 1.0
            i = neg["alphas"].index(row["tuned"]["alpha"])
            assert row["val_control"][i] >= 0.95 * row["val_pretrained"]["control"] - 1e-12
    for mode, cost in report["cost"].items():
        assert cost["steps"] == STEPS * len(TASKS)
        assert cost["finetune_seconds"] > 0 and cost["merge_seconds"] > 0 and cost["peak_rss_bytes"] > 0
        assert cost["trained_now"] == TASKS
        assert cost["total_seconds"] == pytest.approx(cost["finetune_seconds"] + cost["merge_seconds"])
        assert set(cost["method_seconds"]) == set(report["methods"]) and cost["ties_seconds"] is not None
        linear_step = report["cost"]["linear"]["steady_seconds_per_step"]  # the cost table's "vs linear"
        assert cost["steady_over_linear"] == pytest.approx(cost["steady_seconds_per_step"] / linear_step)
    claims = report["claims"]  # taujp at alpha = 1 against nonlinear and linear, apart from taujp's other rows
    assert claims["margin"] == BenchConfig.claim_margin
    assert {r["mode"] for r in claims["baselines"]} == {None, "nonlinear", "linear"}
    assert {r["mode"] for r in claims["variants"]} == {"taujp"}
    for comparison in (*claims["vs_baselines"].values(), *claims["vs_variants"].values()):
        assert comparison["verdict"] == verdict(comparison["difference"], claims["margin"])
    assert "a difference within ±0.50 points is a tie" in " ".join(output.split())
    assert "pearson r" in output


@pytest.mark.slow
@pytest.mark.parametrize("method, mode, options", [("magmax", "nonlinear", {}), ("dare", "nonlinear", {"seed": 0}),
                                                   ("opcm", "taujp", {"share": 0.5}), ("tsv", "taujp", {})])
def test_editkit_add_method_scores_the_bench_row_at_coefficient_one(bench_run, tmp_path, method, mode, options):
    """`editkit add --method` rebuilds the scenario and scores the merged vector with evaluate_vector: the same
    numbers as the bench's row at coefficient 1 (exact tangents for linearized vectors may flip an argmax)."""
    root, _, _, report = bench_run
    out, json_path = tmp_path / "merged.safetensors", tmp_path / "add.json"
    bank = root / "banks" / f"bench-mini-{mode}"
    args = ["add", *TASKS, "--method", method, "--bank", bank, "--out", out, "--tau-only", "--json", json_path]
    for key, value in options.items():
        args += ["--param", f"{key}={value}"]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    numbers = json.loads(json_path.read_text())
    assert numbers["method"] == method and numbers["options"] == {**report["method_options"][method], **options}
    row = next(r for r in report["addition"]["rows"]
               if r["method"] == method and r["mode"] == mode and r["coefficient"] == "1.0")
    tol = 0 if mode == "nonlinear" else 1.01 / N_TEST
    for t in TASKS:
        assert numbers["per_task"][t] == pytest.approx(row["per_task"][t], abs=tol + 1e-12)
    ordered = method in ("magmax", "opcm")  # the merged vector depends on the order: both reports record it
    assert numbers.get("order") == (list(TASKS) if ordered else None)
    assert report["order"].get(method) == (list(TASKS) if ordered else None)
    if method == "magmax":  # the saved vector: per entry, the banked value of larger magnitude (the later on a tie)
        a, b = (Bank(bank).load(t) for t in TASKS)
        saved = load_file(out)
        assert all(torch.equal(saved[k], torch.where(b[k].abs() >= a[k].abs(), b[k], a[k])) for k in a)


@pytest.mark.slow
def test_every_stream_has_its_accuracy_matrix_acc_bwt_and_forgetting(bench_run):
    _, _, output, report = bench_run
    printed = table_rows(output)
    for mode, stream in report["streams"].items():
        merged = [step["merged"]["per_task"] for step in stream["steps"]]
        continual = report["continual"][mode]
        assert continual["matrix"] == [[merged[0][TASKS[0]], None], [merged[1][TASKS[0]], merged[1][TASKS[1]]]]
        assert continual["acc"] == pytest.approx((merged[1][TASKS[0]] + merged[1][TASKS[1]]) / 2)
        assert continual["bwt"] == pytest.approx(merged[1][TASKS[0]] - merged[0][TASKS[0]])
        assert continual["forgetting"] == pytest.approx(-continual["bwt"])  # two tasks: the best is the first
        among = report["continual_class_incremental"][mode]  # the same row's class-incremental half
        assert [mode, *(pct(numbers[k]) for numbers in (continual, among) for k in ("acc", "bwt", "forgetting"))] in printed
    assert report["plots"]["accuracy_matrix"] == "accuracy_matrix.png"


@pytest.mark.slow
def test_every_listed_png_is_a_valid_image(bench_run):
    root, _, _, report = bench_run
    assert set(report["plots"]) >= {"alpha_curves", "incremental", "taujp_matrix", "taujp_correlation", "xi"}
    for name in report["plots"].values():
        path = root / "run" / name
        assert path.is_file()
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
    assert not [p for p in (root / "run").iterdir() if p.name.startswith(".bench-")]


@pytest.mark.slow
def test_each_modes_stream_is_logged_in_its_own_directory(bench_run):
    root, _, _, report = bench_run
    for mode in report["modes"]:
        with open(root / "run" / mode / "steps.csv", newline="") as f:
            steps = list(csv.DictReader(f))
        assert [(r["task"], r["step"]) for r in steps] == [(t, str(s)) for t in TASKS for s in range(STEPS)]
        with open(root / "run" / mode / "experiences.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        streamed = report["streams"][mode]["steps"]
        assert [r["task"] for r in rows] == TASKS
        assert [float(r["merged_absolute"]) for r in rows] == [s["merged"]["absolute"] for s in streamed]


@pytest.mark.slow
def test_second_run_reuses_the_banks(bench_run):
    root, scenario, _, report = bench_run
    args = bench_args(scenario, root, "--modes", "linear", "--methods", "task-arithmetic")
    args[args.index("--run-dir") + 1] = str(root / "run-again")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    again = json.loads((root / "run-again" / "report.json").read_text())
    assert again["cost"]["linear"]["trained_now"] == [] and again["cost"]["linear"]["reused"] == TASKS
    assert again["cost"]["linear"]["finetune_seconds"] == report["cost"]["linear"]["finetune_seconds"]
    assert again["cost"]["linear"]["peak_rss_bytes"] == report["cost"]["linear"]["peak_rss_bytes"]
    same = [r for r in report["addition"]["rows"] if r["mode"] in (None, "linear")
            and r["method"] in ("pretrained", "task-arithmetic", "single-task")]
    assert again["addition"]["rows"] == same
    assert again["taujp"]["matrices"] == {"linear": report["taujp"]["matrices"]["linear"]}
    assert again["claims"] is None  # no tauJp row to judge
    # the first run scored the linearized vectors with the tangents its streams computed (each vector on the tasks
    # up to its own); this one, whose streams trained nothing, computed every tangent: the numbers above are equal
    stream_scored = {TASKS[t]: sorted(TASKS[: t + 1]) for t in range(len(TASKS))}
    assert ADOPTED["linear"] == ADOPTED["taujp"] == stream_scored and ADOPTED["nonlinear"] == {}


class _Stopped(Exception):
    """Raised by a stand-in for the stream once it has seen what it was asked."""


@pytest.mark.parametrize("batch_size, kept", [(EVAL_BATCH_SIZE, True), (EVAL_BATCH_SIZE // 4, False)])
def test_streams_keep_their_tangents_only_for_a_bench_scoring_in_their_batches(bench_run, monkeypatch, batch_size,
                                                                               kept):
    """Another evaluation batch size packs other batches: the stream's tangents would not be the bench's to the
    bit, so the bench asks for none and computes them all."""
    root, scenario, _, _ = bench_run
    asked = []

    def stream(*args, **kwargs):
        asked.append(kwargs["keep_tangents"])
        raise _Stopped

    monkeypatch.setattr("editkit.runs.stream.run_scenario", stream)
    config = BenchConfig(scenario=str(scenario), modes=("linear",), methods=("task-arithmetic",),
                         recipe={"steps": STEPS}, bank_root=root / "banks", run_dir=root / f"run-batch-{batch_size}",
                         batch_size=batch_size)
    with pytest.raises(_Stopped):
        run_bench(config)
    assert asked == [kept]


@pytest.mark.slow
def test_a_bench_over_two_seeds_reuses_the_first_and_reports_means_spreads_and_paired_claims(bench_run):
    """--seeds 2: seed 0 is the one-seed bench's (its banks reused), seed 1 trains beside it; every aggregated
    number is recomputed here from the two seeds' own reports."""
    root, _, _, report = bench_run
    result, over = bench_again(bench_run, "run-seeds", "--modes", "linear,taujp", "--methods", "task-arithmetic,ties",
                               "--seeds", "2")
    assert [(r["name"], r["seed"], r["order"]) for r in over["repeats"]["runs"]] == [("seed-0", 0, TASKS),
                                                                                    ("seed-1", 1, TASKS)]
    seeds = [json.loads((root / "run-seeds" / f"seed-{s}" / "report.json").read_text()) for s in (0, 1)]
    assert seeds[0]["cost"]["taujp"]["trained_now"] == []  # the one-seed bench's banks
    assert seeds[1]["cost"]["taujp"]["trained_now"] == TASKS
    assert Bank(root / "banks" / "seed-1" / f"{report['scenario']}-taujp").names() == TASKS
    first = {(r["method"], r["variant"], r["coefficient"]): r for r in report["addition"]["rows"]}
    for row in seeds[0]["addition"]["rows"]:
        assert row == first[(row["method"], row["variant"], row["coefficient"])]
    assert seeds[1]["addition"]["rows"] != seeds[0]["addition"]["rows"]  # another seed, other vectors
    # negation and the diagnostics run in the first seed alone: the repeated report reads neither
    assert all(key in seeds[0] for key in ("negation", "taujp", "xi")) and "left_out" not in seeds[0]
    assert not any(key in seeds[1] for key in ("negation", "taujp", "xi"))
    assert seeds[1]["left_out"]["sections"] == ["negation", "taujp", "xi"]
    assert not (root / "run-seeds" / "seed-1" / "negation.png").exists()
    assert set(seeds[1]["plots"]) == {"alpha_curves", "incremental", "accuracy_matrix"}
    assert (root / "run-seeds" / "seed-0" / "negation.png").exists()
    for k, row in enumerate(over["addition"]["rows"]):
        values = [s["addition"]["rows"][k]["absolute"] for s in seeds]
        assert row["absolute"] == pytest.approx(np.mean(values))
        assert row["spread"]["absolute"]["std"] == pytest.approx(np.std(values, ddof=1))
    ours = [next(r for r in s["addition"]["rows"] if (r["method"], r["mode"], r["coefficient"]) ==
                 ("task-arithmetic", "taujp", "1.0")) for s in seeds]
    claim = over["claims"]["vs_baselines"]["absolute"]
    against = (claim["against"]["method"], claim["against"]["variant"], "tuned")
    theirs = [next(r for r in s["addition"]["rows"] if (r["method"], r["variant"], r["coefficient"]) == against)
              for s in seeds]
    differences = [o["absolute"] - t["absolute"] for o, t in zip(ours, theirs)]
    assert claim["differences"] == pytest.approx(differences)
    error = abs(differences[0] - differences[1]) / 2  # sample std of two values over sqrt(2)
    assert claim["margin"] == pytest.approx(max(0.005, 2 * error))
    assert over["cost"]["taujp"]["steady_over_linear"]["values"] == [s["cost"]["taujp"]["steady_over_linear"]
                                                                     for s in seeds]
    assert over["continual"]["taujp"]["bwt"]["values"] == [s["continual"]["taujp"]["bwt"] for s in seeds]
    assert " ± " in result.output and "means over 2 seeds" in " ".join(result.output.split())
    with Image.open(root / "run-seeds" / over["plots"]["spread"]) as image:
        assert image.size[0] > 200


@pytest.mark.slow
def test_a_bench_over_two_task_orders_streams_the_tasks_in_each_order(bench_run):
    """--orders 2 over two tasks: the scenario's order (the one-run bench's banks) and the other one, trained in
    banks/order-1 with the same seed; each run's streams and accuracy matrix follow its order."""
    root, _, _, report = bench_run
    result, over = bench_again(bench_run, "run-orders", "--modes", "linear,taujp", "--methods", "task-arithmetic",
                               "--orders", "2")
    assert [(r["name"], r["seed"], r["order"]) for r in over["repeats"]["runs"]] == [
        ("order-0", 0, TASKS), ("order-1", 0, TASKS[::-1])]
    runs = [json.loads((root / "run-orders" / f"order-{k}" / "report.json").read_text()) for k in (0, 1)]
    assert runs[0]["cost"]["taujp"]["trained_now"] == [] and runs[0]["continual"] == {
        mode: report["continual"][mode] for mode in ("linear", "taujp")}
    assert runs[1]["tasks"] == TASKS[::-1] and runs[1]["cost"]["taujp"]["trained_now"] == TASKS[::-1]
    assert [s["task"] for s in runs[1]["streams"]["taujp"]["steps"]] == TASKS[::-1]
    assert runs[1]["continual"]["taujp"]["tasks"] == TASKS[::-1]
    bank = Bank(root / "banks" / "order-1" / f"{report['scenario']}-taujp")
    assert bank.names() == TASKS[::-1] and [e.recipe["seed"] for e in bank.entries()] == [0, 0]
    for k, row in enumerate(over["addition"]["rows"]):
        for task in TASKS:
            assert row["per_task"][task] == pytest.approx(np.mean([r["addition"]["rows"][k]["per_task"][task]
                                                                   for r in runs]))
    assert over["continual"]["taujp"]["bwt"]["values"] == [r["continual"]["taujp"]["bwt"] for r in runs]
    assert "mean ± std over 2 task orders" in " ".join(result.output.split())


@pytest.mark.slow
def test_avalanche_strategies_run_the_same_stream_beside_the_modes(bench_run):
    """--strategies: each strategy's row is its model after the last task, its matrix the stream's scores, and the
    claims weigh tauJp against the rehearsal-free ones, the rehearsal ones and joint training apart."""
    result, got = bench_again(bench_run, "run-strategies", "--modes", "taujp", "--methods", "task-arithmetic,ties",
                              "--strategies", "naive,lwf,replay,joint", "--strategy-params", "replay.mem_size=50",
                              "--matrices")
    assert got["cost"]["taujp"]["trained_now"] == []  # the banks are the one-mode bench's
    rows = {r["method"]: r for r in got["addition"]["rows"] if r["variant"] == "avalanche"}
    assert list(rows) == ["naive", "lwf", "replay", "joint"]
    for name, row in rows.items():
        matrix, among = (got["strategies"][name]["rows"][protocol] for protocol in ("task", "class"))
        assert row["per_task"] == matrix[-1] and row["absolute"] == pytest.approx(np.mean(list(matrix[-1].values())))
        assert got["continual"][name]["acc"] == pytest.approx(row["absolute"])
        assert row["normalized"] is None  # a strategy has no single-task models to divide by
        if name == "joint":
            assert len(matrix) == len(among) == 1 and got["continual"][name]["bwt"] is None
        else:
            assert [list(r) for r in matrix] == [list(r) for r in among] == [TASKS[:1], TASKS]
            assert got["continual"][name]["bwt"] == pytest.approx(matrix[1][TASKS[0]] - matrix[0][TASKS[0]])
            assert row["class_bwt"] == pytest.approx(among[1][TASKS[0]] - among[0][TASKS[0]])
        assert [run["steps"] for run in got["strategy_cost"][name]["protocols"].values()] == [STEPS * len(TASKS)] * 2
        assert row["class_incremental"] == pytest.approx(np.mean(list(among[-1].values())))
    assert got["strategies"]["replay"]["options"]["task"]["mem_size"] == 50 and got["kept"]["replay"]["items"] == 50
    # every row under both protocols: the merged model's class-IL accuracy at alpha = 1 is its matrix's ACC
    ours = next(r for r in got["addition"]["rows"] if r["mode"] == "taujp" and r["coefficient"] == "1.0")
    assert ours["class_incremental"] == pytest.approx(got["continual_class_incremental"]["taujp"]["acc"])
    assert ours["class_bwt"] == got["continual_class_incremental"]["taujp"]["bwt"]
    assert next(r for r in got["addition"]["rows"] if r["method"] == "single-task")["class_incremental"] is None
    # what each row keeps after the last task, of the first: by hand from the bank and the inputs' size
    entry = Bank(bench_run[0] / "banks" / f"{got['scenario']}-taujp").get(TASKS[0])
    examples, classes, features = (entry.prototypes[k] for k in ("examples", "classes", "features"))
    parts = {p["what"]: p for p in got["kept"]["taujp"]["parts"]}
    assert parts["vectors"]["items"] == 1
    assert parts["vectors"]["bytes"] == (bench_run[0] / "banks" / f"{got['scenario']}-taujp" / entry.file).stat().st_size
    # every training input of the first task (its prototypes average them all: fewer than the cap a class), RGB fp32
    assert parts["unlabeled inputs of every earlier task"]["items"] == examples
    assert parts["unlabeled inputs of every earlier task"]["bytes"] == examples * 3 * 32 * 32 * 4
    assert parts["class statistics"] == {"what": "class statistics", "items": classes,
                                         "bytes": 4 * classes * features + 4 * features * features}
    assert got["kept"]["pretrained"]["items"] == classes and got["kept"]["naive"]["items"] == 0
    assert "continual-learning-baselines" in got["strategies"]["lwf"]["defaults_from"]
    ours = next(r for r in got["addition"]["rows"] if r["mode"] == "taujp" and r["coefficient"] == "1.0")
    free = got["claims"]["vs_strategies"]["rehearsal_free"]["absolute"]
    assert free["difference"] == pytest.approx(ours["absolute"] - max(rows[n]["absolute"] for n in ("naive", "lwf")))
    assert got["claims"]["vs_strategies"]["joint"]["absolute"]["against"]["method"] == "joint"
    printed = table_rows(result.output)
    assert any(line[:2] == ["Naive", "avalanche"] for line in printed)
    assert any(line[:3] == ["replay", "50 labelled examples", "50"] for line in printed)  # what each row keeps
    assert any(line[0] == "strategy, rehearsal-free" for line in printed)
    # --matrices: each merge method's rows too; the sum's are the stream's own (tangents: an argmax may flip)
    for own, stream in zip(got["continual"]["taujp/task-arithmetic"]["matrix"], got["continual"]["taujp"]["matrix"]):
        assert own == [None if v is None else pytest.approx(v, abs=1.01 / N_TEST) for v in stream]
    ties = got["continual"]["taujp/ties"]
    assert ties["matrix"][-1] == [next(r for r in got["addition"]["rows"] if r["method"] == "ties"
                                       and r["coefficient"] == "1.0")["per_task"][t] for t in TASKS]
    # task-incremental half of the continual table (a method's merge after each step has no class-IL matrix)
    assert ["taujp/ties", pct(ties["acc"]), pct(ties["bwt"]), pct(ties["forgetting"]), "—", "—", "—"] in printed
    # a re-run over the same banks reads every strategy run back from its record: nothing trained, the same rows
    result, again = bench_again(bench_run, "run-strategies-again", "--modes", "taujp", "--methods", "task-arithmetic",
                                "--strategies", "naive,lwf,replay,joint", "--strategy-params", "replay.mem_size=50")
    assert again["strategies"] == got["strategies"] and again["kept"] == got["kept"]
    assert " ".join(result.output.split()).count("recorded by an earlier run") == 8  # 4 strategies x 2 protocols
    # their cost is the earlier run's, and says so: the first run trained all, the re-run read every one back
    assert all(c["recorded"] == [] for c in got["strategy_cost"].values())
    assert {n: c["recorded"] for n, c in again["strategy_cost"].items()} == dict.fromkeys(rows, ["task", "class"])
    assert again["strategy_cost"]["lwf"]["train_seconds"] == got["strategy_cost"]["lwf"]["train_seconds"]
    assert any(line[0].startswith("lwf (recorded: task, class)") for line in table_rows(result.output))
    assert len(list((bench_run[0] / "banks" / "strategies").glob("*.json"))) == 8


# --- refusals: one red line, nothing written --------------------------------------------------


def refused(args: list[str], *needles: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), result.output
    for needle in needles:
        assert needle in result.output, result.output
    return result.output


def test_bad_options_are_refused_before_anything_runs(tmp_path):
    scenario = write_scenario(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("previous")
    base = ["bench", "--scenario", str(scenario), "--bank-root", str(tmp_path / "banks"), "--run-dir", str(run)]
    refused(base + ["--modes", "linear,lienar"], "lienar")
    refused(base + ["--methods", "ties,magmaxx"], "magmaxx")
    refused(base + ["--grid", "0"], "empty")
    refused(base + ["--seeds", "0"], "at least 1")
    refused(base + ["--strategies", "naive,gem"], "unknown strategies 'gem'", "agem, ewc, joint, lwf, naive, replay, si")
    refused(base + ["--strategies", "ewc", "--strategy-params", "ewc.lamda=3"],
            "strategy 'ewc': unknown option 'lamda'; known: ewc_lambda, mode")
    refused(base + ["--strategies", "ewc", "--strategy-params", "ewc.ewc_lambda=strong"],
            "strategy 'ewc': ewc_lambda must be a number, got 'strong'")
    refused(base + ["--strategies", "ewc", "--strategy-params", "lwf.alpha=2"], "lwf, which --strategies does not run")
    refused(base + ["--grid", "1"], "at least 2")
    refused(base + ["--negation-grid", "0"], "empty")
    refused(base + ["--negation-max", "0"], "positive")
    bad_choice = runner.invoke(app, base + ["--control", "imagenett"])  # the command line knows the choices
    assert bad_choice.exit_code == 2 and "imagenett" in bad_choice.output and "Traceback" not in bad_choice.output
    refused(base + ["--steps", "0"], "steps must be >= 1")
    refused(base + ["--control", "imagenet"], "ImageNet")  # no local copy: refused before any training
    if not torch.cuda.is_available():
        refused(base + ["--device", "cuda"], "CUDA is not available")
    refused(base + ["--xi-pair", "digits,cifar"], "cifar")
    refused(base + ["--adapters", "none,lora", "--adapter", "lora"], "--adapters", "not both")
    refused(base + ["--adapters", "none,dora"], "unknown adapters 'dora'")
    refused(base + ["--penalties", "inputs,kfac", "--penalty", "kfac"], "--penalties", "not both")
    refused(base + ["--penalties", "inputs,tak"], "unknown penalties 'tak'")
    refused(base + ["--penalty", "kfac", "--penalty-on", "logits"],
            "penalty_on = 'logits' measures through one head every task shares")
    one = write_scenario(tmp_path, tasks=["digits"], name="bench-one")
    refused(["bench", "--scenario", str(one), "--run-dir", str(run)], "at least 2")
    assert (run / "report.json").read_text() == "previous"
    assert not (tmp_path / "banks").exists()


def test_mismatched_banks_are_refused_before_training(tmp_path):
    scenario = write_scenario(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("previous")
    args = ["bench", "--scenario", str(scenario), "--steps", "1", "--bank-root", str(tmp_path / "banks"),
            "--run-dir", str(run)]
    # another base model
    other = Bank(tmp_path / "banks" / "bench-mini-linear")
    other.append("digits", {"w": torch.zeros(2)}, task="digits", mode="linear", base="sha256:" + "0" * 64,
                 scenario="bench-mini")
    refused(args, "base")
    # the right base, but a task the scenario does not have
    spec = scenario_spec.load_scenario(scenario)
    fingerprint = scenario_mod.build_backbone(spec).fingerprint()
    other.remove("digits")
    other.append("cifar", {"w": torch.zeros(2)}, task="cifar", mode="linear", base=fingerprint, scenario="bench-mini")
    refused(args, "cifar", "not a task")
    # the right task, another recipe
    other.remove("cifar")
    recipe = spec.recipe.with_overrides(mode="linear", steps=7).to_dict()
    other.append("digits", {"w": torch.zeros(2)}, task="digits", mode="linear", base=fingerprint,
                 scenario="bench-mini", recipe=recipe)
    refused(args, "recipe", "steps 7 banked, 1 now")
    # everything recorded matches (a reg batch is not compared in a mode without the penalty: it did not shape
    # the vector), but the tensors do not fit the backbone
    other.remove("digits")
    recipe = spec.recipe.with_overrides(mode="linear", steps=1, reg_batch=7).to_dict()
    other.append("digits", {"w": torch.zeros(2)}, task="digits", mode="linear", base=fingerprint,
                 scenario="bench-mini", recipe=recipe)
    refused(args, "does not fit", "'w'")
    assert (run / "report.json").read_text() == "previous"
    assert [p.name for p in run.iterdir()] == ["report.json"]
    for mode in ("nonlinear", "taujp"):  # no stream started: the other modes' banks were never created
        assert not (tmp_path / "banks" / f"bench-mini-{mode}").exists()


def test_negation_caption_names_the_rows_whose_tuned_alpha_is_the_grid_top():
    from rich.console import Console

    from editkit.runs.bench.tables import negation_table

    def row(task: str, alpha: float) -> dict:
        cell = {"target": 0.5, "control": 0.6}
        return {"task": task, "pretrained": cell, "alpha1": {"alpha": 1.0, **cell}, "tuned": {"alpha": alpha, **cell}}

    def render(alphas_tuned: dict) -> str:
        rows = [row(t, a) for t, a in alphas_tuned.items()]
        neg = {"alphas": [0.0, 0.5, 1.0], "retain": 0.95, "control": "other tasks", "rows": rows,
               "mean": {k: {"target": 0.5, "control": 0.6} for k in ("pretrained", "alpha1", "tuned")}}
        console = Console(width=400, record=True)
        console.print(negation_table({"negation": {"taujp": neg}, "negation_grid": [0.0, 0.5, 1.0]}))
        return console.export_text()

    text = render({"a": 1.0, "b": 0.5})
    assert "grid's top (1) for taujp a:" in text and "taujp b" not in text and "--negation-max 2" in text
    assert "grid's top" not in render({"a": 0.5, "b": 0.0})


@pytest.mark.slow
def test_a_bench_of_adapter_vectors_scores_what_its_streams_scored(tmp_path):
    """--adapter lora in every mode's stream (plain LoRA and L-LoRA + tauJp): banks of their own, and the
    bench's alpha = 1 sums equal the streams' own merged scores (plain-LoRA vectors summed as weight updates)."""
    scenario = write_scenario(tmp_path)
    result = runner.invoke(app, bench_args(scenario, tmp_path, "--adapter", "lora", "--lora-rank", 2, "--lr", "2e-3",
                                           "--modes", "nonlinear,taujp", "--methods", "task-arithmetic,ties"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "banks").iterdir()) == ["bench-mini-nonlinear-lora", "bench-mini-taujp-lora"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    for mode in ("nonlinear", "taujp"):
        vector = Bank(tmp_path / "banks" / f"bench-mini-{mode}-lora").load("digits")
        assert vector and all(".lora_" in key for key in vector)
        assert_rows_score_what_the_stream_scored(report, f"{mode}-lora")


def test_a_from_sum_bench_measures_each_task_against_the_model_its_fine_tuning_ended_at(tmp_path):
    """--from-sum: each task's single-task model is theta_0 plus the vectors up to its own (where its fine-tuning
    ended), in the bench as in the stream, which scored it as the merged model after its step; the sum at alpha =
    1 is the stream's merged model."""
    scenario = write_scenario(tmp_path)
    result = runner.invoke(app, bench_args(scenario, tmp_path, "--from-sum", "--modes", "taujp", "--methods",
                                           "task-arithmetic", "--protocols", "task"))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert_rows_score_what_the_stream_scored(report, "taujp")
    steps = report["streams"]["taujp"]["steps"]
    for step in steps:
        assert step["single_task"] == step["merged"]["per_task"][step["task"]]
        assert report["single_task"]["taujp"]["test"][step["task"]] == pytest.approx(step["single_task"],
                                                                                      abs=1.01 / N_TEST + 1e-12)
    vectors = Bank(tmp_path / "banks" / "bench-mini-taujp").load(TASKS[-1])
    assert Bank(tmp_path / "banks" / "bench-mini-taujp").get(TASKS[-1]).recipe["from_sum"] is True and vectors


def assert_rows_score_what_the_stream_scored(report: dict, label: str) -> None:
    """The bench's task arithmetic at alpha = 1 over one stream's vectors equals the stream's own merged scores
    (linearized: within one test example, the stream's f_lin is a jvp per batch, the bench's a cached tangent)."""
    last = report["streams"][label]["steps"][-1]
    row = next(r for r in report["addition"]["rows"]
               if r["method"] == "task-arithmetic" and r["variant"] == label and r["coefficient"] == "1.0")
    tol = 0 if row["mode"] == "nonlinear" else 1.01 / N_TEST
    for t in TASKS:
        assert row["per_task"][t] == pytest.approx(last["merged"]["per_task"][t], abs=tol + 1e-12)


@pytest.mark.slow
def test_a_bench_shows_adapter_and_full_rows_side_by_side(tmp_path):
    """--adapters none,lora: each mode's stream runs twice, full vectors on theta_0 and LoRA vectors on theta_0
    with the adapter, each at its own learning rate (--lora-lr); every row scores what its own stream scored."""
    scenario = write_scenario(tmp_path)
    result = runner.invoke(app, bench_args(scenario, tmp_path, "--adapters", "none,lora", "--lora-rank", 2,
                                           "--lora-lr", "2e-3", "--modes", "nonlinear,taujp",
                                           "--methods", "task-arithmetic"))
    assert result.exit_code == 0, result.output
    labels = ["nonlinear", "taujp", "nonlinear-lora", "taujp-lora"]
    assert sorted(p.name for p in (tmp_path / "banks").iterdir()) == sorted(f"bench-mini-{v}" for v in labels)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["modes"] == labels and list(report["cost"]) == labels
    assert all(report["cost"][label]["steady_over_linear"] is None for label in labels)  # no linear stream to compare
    for label in labels:
        bank = Bank(tmp_path / "banks" / f"bench-mini-{label}")
        lora = label.endswith("-lora")
        vector = bank.load("digits")
        assert vector and all((".lora_" in key) == lora for key in vector)
        assert bank.get("digits").recipe["lr"] == (2e-3 if lora else Recipe().lr)  # the scenario sets no lr
        assert_rows_score_what_the_stream_scored(report, label)
    assert len({Bank(tmp_path / "banks" / f"bench-mini-{v}").base for v in labels}) == 2  # one theta_0 per arm
    printed = {row[1] for row in table_rows(result.output) if row and row[0] == "task arithmetic"}
    assert set(labels) <= printed, result.output
    assert report["claims"]["taujp_alpha1"]["variant"] == "taujp"  # the first adapter named: none


@pytest.mark.slow
def test_a_bench_shows_the_input_and_the_data_free_penalties_side_by_side(tmp_path):
    """--penalties inputs,kfac: the penalized mode's stream runs twice, once drawing the seen tasks' inputs and once
    reading their banked curvature; every row scores what its own stream scored."""
    scenario = write_scenario(tmp_path)
    result = runner.invoke(app, bench_args(scenario, tmp_path, "--penalties", "inputs,kfac", "--curvature-examples",
                                           16, "--modes", "linear,taujp", "--methods", "task-arithmetic"))
    assert result.exit_code == 0, result.output
    labels = ["linear", "taujp", "taujp-kfac"]
    assert sorted(p.name for p in (tmp_path / "banks").iterdir()) == sorted(f"bench-mini-{v}" for v in labels)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["modes"] == labels
    kfac = Bank(tmp_path / "banks" / "bench-mini-taujp-kfac")
    assert all(kfac.get(n).curvature["examples"] == 16 for n in kfac.names())
    assert not any(Bank(tmp_path / "banks" / f"bench-mini-{v}").get(n).curvature
                   for v in ("linear", "taujp") for n in kfac.names())
    for label in labels:
        assert_rows_score_what_the_stream_scored(report, label)
    assert report["cost"]["taujp-kfac"]["steady_over_linear"] is not None
    printed = {row[1] for row in table_rows(result.output) if row and row[0] == "task arithmetic"}
    assert set(labels) <= printed, result.output
