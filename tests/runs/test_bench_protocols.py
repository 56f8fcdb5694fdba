"""The bench's protocols, what each row keeps of earlier tasks, the claims against the strategies (ACC and BWT
per protocol, never a strategy's own "normalized") and ``--tune``'s selection grid, on hand-written inputs."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from editkit.errors import ConfigError
from editkit.runs.bench.claims import CONTINUAL, claims
from editkit.runs.bench.config import BenchConfig
from editkit.runs.bench.kept import inputs_bytes, stream_kept, total
from editkit.runs.bench.report import METHOD_LABELS, with_backward_transfer
from editkit.runs.bench.selection import TRIALS, Trial, check_tune, choose, trial_grid
from editkit.scenario.spec import load_scenario
from editkit.util.memory import nbytes
from editkit.runs.bench.run import run_bench
from helpers.scenarios import write_scenario

MARGIN = 0.005


# --- protocols -------------------------------------------------------------------------------------------------


def test_protocols_default_to_every_one_a_scenario_runs_and_a_language_scenario_refuses_them():
    vision, language = load_scenario("split-mnist"), load_scenario("toxic")
    assert BenchConfig().validated().protocols_of(vision) == ("task", "class")
    assert BenchConfig(protocols="class,task").validated().protocols == ("task", "class")  # PROTOCOLS' order
    assert BenchConfig(protocols="class").validated().protocols_of(vision) == ("class",)
    assert BenchConfig().validated().protocols_of(language) == ()
    with pytest.raises(ConfigError, match="'toxic' is a language-model scenario, scored by perplexity"):
        BenchConfig(protocols="class").validated().protocols_of(language)
    with pytest.raises(ConfigError, match="unknown protocols 'clas'; choose from task, class"):
        BenchConfig(protocols="clas").validated()


# --- what each row keeps ---------------------------------------------------------------------------------------


def test_nbytes_counts_data_as_it_is_held():
    assert nbytes(torch.zeros(3, 32, 32)) == 3 * 32 * 32 * 4
    assert nbytes(torch.zeros(5, dtype=torch.int64)) == 40
    assert nbytes(np.zeros((2, 2), dtype=np.float16)) == 8
    assert nbytes("héllo") == 6  # UTF-8
    assert nbytes({"ids": torch.zeros(7, dtype=torch.int32), "mask": [1, 1]}) == 28 + 16
    from editkit.core.batching import SequenceBatch

    assert nbytes(SequenceBatch(torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64))) == 160
    with pytest.raises(TypeError, match="object"):
        nbytes(object())


def test_inputs_bytes_scales_an_even_sample_to_the_count():
    images = [torch.zeros(1, 28, 28)] * 1000
    assert inputs_bytes(1000, images.__getitem__) == 1000 * 28 * 28 * 4
    texts = ["x" * k for k in range(50)]  # up to SAMPLED inputs: every one counted
    assert inputs_bytes(50, texts.__getitem__) == sum(range(50))
    texts = ["ab", "abcd"] * 512  # more: an even sample (every 16th: the short ones) scaled to the count
    assert inputs_bytes(1024, texts.__getitem__) == 2 * 1024
    assert inputs_bytes(0, texts.__getitem__) == 0


def test_a_rows_entry_sums_its_parts_and_names_what_it_keeps():
    kept = total([{"what": "vectors", "items": 2, "bytes": 100}, {"what": "curvature", "items": 0, "bytes": 0},
                  {"what": "class prototypes", "items": 4, "bytes": 64}])
    assert kept == {"what": "vectors; class prototypes", "items": 6, "bytes": 164, "mib": 164 / 2**20,
                    "parts": [{"what": "vectors", "items": 2, "bytes": 100},
                              {"what": "class prototypes", "items": 4, "bytes": 64}]}
    assert total([]) == {"what": "nothing", "items": 0, "bytes": 0, "mib": 0.0, "parts": []}


def test_a_stream_keeps_the_generic_source_under_either_penalty_and_curvature_files_under_kfac(tmp_path):
    """Both penalties read the generic source (drawn from; its curvature computed from it each stream), so both
    keep its inputs; kfac keeps each earlier task's curvature file instead of its inputs. By hand: 5 generic
    inputs of 2 x 3 fp32, 7 task inputs of the same, files of 10 and 30 bytes."""
    from types import SimpleNamespace

    from editkit.train.recipe import Recipe

    (tmp_path / "a.safetensors").write_bytes(b"v" * 10)
    (tmp_path / "a.curvature.safetensors").write_bytes(b"c" * 30)
    entry = SimpleNamespace(name="a", file="a.safetensors", curvature={"file": "a.curvature.safetensors"})
    bank = SimpleNamespace(root=tmp_path, entries=lambda: [entry])
    generic = type("Generic", (), {"__len__": lambda self: 5, "load": lambda self, rows: torch.zeros(len(rows), 2, 3)})()
    task = SimpleNamespace(train=[(torch.zeros(2, 3), 0)] * 7)
    built = SimpleNamespace(generic=generic, task=lambda name: task)

    def parts(penalty: str) -> dict:
        state = SimpleNamespace(bank=bank, recipe=Recipe(mode="taujp", penalty=penalty))
        return {p["what"]: (p["items"], p["bytes"]) for p in stream_kept(state, built, ["a", "b"], ["task"])["parts"]}

    assert parts("inputs") == {"vectors": (1, 10), "unlabeled inputs of every earlier task": (7, 7 * 24),
                               "generic unlabeled inputs": (5, 5 * 24)}
    assert parts("kfac") == {"vectors": (1, 10), "curvature of every earlier task": (1, 30),
                             "generic unlabeled inputs": (5, 5 * 24)}


# --- claims against the strategies -----------------------------------------------------------------------------


def _row(method, variant, coefficient, absolute, normalized=None, **extra):
    return {"method": method, "label": METHOD_LABELS[method], "mode": variant if variant != "avalanche" else None,
            "variant": variant, "coefficient": coefficient, "alpha": 1.0 if coefficient else None,
            "absolute": absolute, "normalized": normalized, "per_task": {}, **extra}


def test_rows_that_are_streams_of_models_carry_their_bwt_per_protocol():
    rows = [_row("task-arithmetic", "taujp", "1.0", 0.9, 0.95), _row("task-arithmetic", "taujp", "tuned", 0.9, 0.95),
            _row("lwf", "avalanche", None, 0.8), _row("pretrained", None, None, 0.5)]
    continual = {"taujp": {"bwt": -0.01}, "lwf": {"bwt": -0.05}}
    with_backward_transfer(rows, continual, {"taujp": {"bwt": -0.2}})
    assert [(r["bwt"], r["class_bwt"]) for r in rows] == [(-0.01, -0.2), (None, None), (-0.05, None), (None, None)]


def test_taujp_meets_the_strategies_on_acc_and_bwt_of_each_protocol_not_on_their_normalized():
    ours = _row("task-arithmetic", "taujp", "1.0", 0.90, 0.97, bwt=-0.010, class_incremental=0.60, class_bwt=-0.10)
    lwf = _row("lwf", "avalanche", None, 0.92, 0.99, bwt=-0.030, class_incremental=0.20, class_bwt=-0.70)
    ewc = _row("ewc", "avalanche", None, 0.88, 0.999, bwt=-0.005, class_incremental=0.25, class_bwt=-0.60)
    replay = _row("replay", "avalanche", None, 0.95, None, bwt=-0.002, class_incremental=0.80, class_bwt=-0.15)
    rows = [_row("pretrained", None, None, 0.5), _row("task-arithmetic", "linear", "tuned", 0.85, 0.9), ours, lwf,
            ewc, replay]
    judged = claims(rows, MARGIN)["vs_strategies"]
    free = judged["rehearsal_free"]
    assert set(free) == set(CONTINUAL) and "normalized" not in free
    assert free["absolute"]["verdict"] == "behind" and free["absolute"]["against"]["method"] == "lwf"
    assert free["bwt"]["verdict"] == "tie" and free["bwt"]["against"]["method"] == "ewc"  # -0.010 vs -0.005
    assert free["class_incremental"]["verdict"] == "ahead" and free["class_incremental"]["difference"] == pytest.approx(0.35)
    assert free["class_bwt"]["verdict"] == "ahead" and free["class_bwt"]["against"]["method"] == "ewc"
    assert judged["rehearsal"]["class_incremental"]["verdict"] == "behind"
    assert judged["rehearsal"]["class_incremental"]["difference"] == pytest.approx(-0.20)


def test_a_protocol_not_run_is_not_claimed():
    ours = _row("task-arithmetic", "taujp", "1.0", 0.90, 0.97, bwt=-0.01, class_incremental=None, class_bwt=None)
    naive = _row("naive", "avalanche", None, 0.80, bwt=-0.2, class_incremental=None, class_bwt=None)
    free = claims([_row("pretrained", None, None, 0.5), ours, naive], MARGIN)["vs_strategies"]["rehearsal_free"]
    assert free["class_incremental"] is None and free["class_bwt"] is None
    assert free["absolute"]["verdict"] == "ahead"


# --- selection (--tune) ----------------------------------------------------------------------------------------


def test_every_row_gets_the_same_trials_around_its_defaults():
    with_coefficient, lr_only = trial_grid(1e-4, 0.1), trial_grid(1e-4, None)
    assert len(with_coefficient) == len(lr_only) == TRIALS
    assert Trial(1e-4, 0.1) in with_coefficient  # the defaults are one trial
    assert sorted({t.coefficient for t in with_coefficient}) == pytest.approx([0.01, 0.1, 1.0])
    assert sorted({t.lr for t in with_coefficient}) == pytest.approx([1e-4 / 3, 1e-4, 3e-4])
    lrs = [t.lr for t in lr_only]  # the same span, nine points evenly spaced in log scale, the default in the middle
    assert lrs[0] == pytest.approx(1e-4 / 3) and lrs[-1] == pytest.approx(3e-4) and lrs[4] == pytest.approx(1e-4)
    assert np.allclose(np.diff(np.log(lrs)), math.log(9) / 8)
    assert all(t.coefficient is None for t in lr_only)


def test_the_best_trial_wins_and_a_tie_goes_to_the_first():
    assert choose([0.1, 0.5, 0.3, 0.5, 0, 0, 0, 0, 0]) == 1


def test_tune_needs_an_experience_to_select_on_and_one_left():
    check_tune(2, 5)
    for bad in (0, 5, 7):
        with pytest.raises(ConfigError, match="give 1 to 4"):
            check_tune(bad, 5)
    with pytest.raises(ConfigError, match="--tune is a number of experiences"):
        BenchConfig(tune=-1).validated()


@dataclasses.dataclass(frozen=True)
class _Task:
    name: str
    num_classes: int = 2


@dataclasses.dataclass
class _Built:
    tasks: list
    backbone: object


def _built(*tasks: str) -> _Built:
    from types import SimpleNamespace

    return _Built([_Task(t) for t in tasks], SimpleNamespace(fingerprint=lambda: "sha256:base"))


def test_a_strategy_trial_s_score_is_recorded_and_read_back_only_for_the_same_inputs(tmp_path, monkeypatch):
    """A re-run reads a strategy trial's recorded score instead of training again; another learning rate, another
    thread count or a torn record trains again, and the record then holds the new score."""
    from types import SimpleNamespace

    from editkit.integrations.avalanche import strategies
    from editkit.runs.bench.selection import strategy_trial
    from editkit.runs.bench.strategy_records import StrategyRecord
    from editkit.train.recipe import Recipe
    from editkit.train.runtime import Runtime
    from editkit.util.progress import NullProgress

    runs = []

    def fake_run(name, part, recipes, *, options, protocol, **_):  # accuracy = the lr, so a score names its inputs
        runs.append((protocol, recipes[0].lr))
        return SimpleNamespace(rows=[{t.name: recipes[0].lr * 1000 for t in part.tasks}])

    monkeypatch.setattr(strategies, "run_strategy", fake_run)
    built = _built("a", "b", "c")
    record = StrategyRecord(tmp_path / "tune" / "trial-4" / "mini-lwf.json", {"scenario_file": "sha256:mini"})

    def trial(recipe=Recipe(lr=1e-4)):  # LwF's trial 4: its default lr and alpha
        return strategy_trial("lwf", built, [recipe] * 2, {}, 4, runtime=Runtime(), progress=NullProgress(),
                              protocols=("task", "class"), experiences=2, record=record)

    assert trial() == pytest.approx(0.1) and runs == [("task", 1e-4), ("class", 1e-4)]  # trial 4: the default lr
    assert trial() == pytest.approx(0.1) and len(runs) == 2  # read back: nothing trained
    assert trial(Recipe(lr=3e-4)) == pytest.approx(0.3) and len(runs) == 4  # another lr: trained again
    assert trial() == pytest.approx(0.1) and len(runs) == 6  # the record held lr 3e-4's: trained again
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        trial()
        assert len(runs) == 8
    finally:
        torch.set_num_threads(threads)
    record.path.write_text(record.path.read_text()[:40])  # torn
    assert trial() == pytest.approx(0.1) and len(runs) == 10
    assert trial() == pytest.approx(0.1) and len(runs) == 10
    # the tauJp rows' own fields (their lambda, where they start) are not the strategy's: read back
    assert trial(Recipe(lr=1e-4, lam=0.5, from_sum=True, reg_batch=4)) == pytest.approx(0.1) and len(runs) == 10
    assert trial(Recipe(lr=1e-4, weight_decay=0.01)) == pytest.approx(0.1) and len(runs) == 12  # its optimizer's are


def test_a_finished_strategy_run_is_recorded_and_read_back_only_for_the_same_inputs(tmp_path, monkeypatch):
    """A bench re-run reads each strategy run's recorded result (every field as the run returned it) instead of
    training again; another option, another task order, another protocol or another Avalanche release trains, and
    nothing is recorded without a place to record it."""
    from editkit.integrations.avalanche.strategies import StrategyResult
    from editkit.runs.bench import strategies
    from editkit.runs.bench.strategy_records import StrategyRecord
    from editkit.train.recipe import Recipe
    from editkit.train.runtime import Runtime

    class Lines:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def note(self, message: str) -> None:
            self.lines.append(message)

    runs = []

    def fake_run(name, built, recipes, *, options, protocol, **_):
        runs.append((name, protocol, options.get("alpha"), [t.name for t in built.tasks]))
        return StrategyResult(name, protocol, [{t.name: 0.5 + len(runs) / 100 for t in built.tasks}], dict(options),
                              train_seconds=1.5, steps=4, peak_rss_bytes=123,
                              kept={"what": "a model copy", "items": 1, "bytes": 640})

    monkeypatch.setattr(strategies, "run_strategy", fake_run)

    def records(name, protocol):
        return StrategyRecord(tmp_path / "strategies" / f"mini-{name}-{protocol}.json", {"scenario_file": "sha256:x"})

    def run(built=_built("a", "b"), params=None, protocols=("task", "class"), where=records, progress=None):
        return strategies.run_strategies(["lwf"], params or {}, built, [Recipe(lr=1e-4)] * 2, runtime=Runtime(),
                                         progress=progress or Lines(), protocols=protocols, records=where)["lwf"]

    first = run()
    assert [r[1] for r in runs] == ["task", "class"]
    lines = Lines()
    again = run(progress=lines)
    # read back whole (rows, options, seconds, steps, memory, kept), marked with the record it came from
    assert len(runs) == 2 and {p: dataclasses.replace(r, recorded=None) for p, r in again.items()} == first
    assert first["task"].recorded is None and again["task"].recorded == str(records("lwf", "task").path)
    assert strategies.strategy_cost(first)["recorded"] == [] and strategies.run_cost(first["class"])["recorded"] is None
    assert strategies.strategy_cost(again)["recorded"] == ["task", "class"]
    assert isinstance(again["task"], StrategyResult) and again["task"].kept["bytes"] == 640
    assert len(lines.lines) == 2 and all("recorded by an earlier run" in line for line in lines.lines)
    run(params={"lwf": {"alpha": 2.0}}, protocols=("class",))  # another option: trained again
    assert runs[-1] == ("lwf", "class", 2.0, ["a", "b"]) and len(runs) == 3
    run(built=_built("b", "a"), protocols=("task",))  # the tasks in another order: trained again
    assert runs[-1][3] == ["b", "a"] and len(runs) == 4
    run(where=None, protocols=("task",))  # no place to record: trained, nothing read back
    assert len(runs) == 5
    from editkit.runs.bench import strategy_records

    run(protocols=("task",))  # the record held the other order's: trained, then read back
    run(protocols=("task",))
    assert len(runs) == 6
    monkeypatch.setattr(strategy_records, "version", lambda package: "0.7.0")
    run(protocols=("task",))  # another Avalanche release: trained again
    assert len(runs) == 7


def test_a_trial_record_keys_on_the_scenario_file_s_content_not_where_it_lies(tmp_path):
    """Two nodes that installed the same scenario file at different paths key a strategy's records alike (one
    reads what the other ran); an edited file keys otherwise (its runs train again)."""
    import shutil

    from editkit.runs.bench.config import BenchConfig
    from editkit.runs.bench.strategy_records import StrategyRecord
    from editkit.scenario.spec import load_scenario

    config = BenchConfig(bank_root=str(tmp_path / "banks"))
    copies = []
    for node in ("node-a", "node-b", "edited"):
        (tmp_path / node).mkdir()
        copies.append(shutil.copy(load_scenario("split-mnist").path, tmp_path / node / "split-mnist.toml"))
    with open(copies[2], "a") as fh:
        fh.write("\n# edited\n")
    a, b, edited = (StrategyRecord.trial(config, load_scenario(c), "lwf", 3) for c in copies)
    assert a.path == b.path == tmp_path / "banks" / "tune" / "trial-3" / "split-mnist-lwf.json"
    assert a.scenario == b.scenario
    assert edited.scenario != a.scenario
    assert str(tmp_path) not in json.dumps(a.scenario)
    run = StrategyRecord.run(config, load_scenario(copies[1]), "lwf", "class")
    assert run.path == tmp_path / "banks" / "strategies" / "split-mnist-lwf-class.json" and run.scenario == a.scenario


# --- end to end ------------------------------------------------------------------------------------------------


def test_tune_selects_every_row_on_validation_with_the_same_trials_and_runs_the_choice(tmp_path):
    """--tune 1: tauJp's and EWC's nine trials on the first task's validation split, each row's choice the best of
    its scores, then the whole stream once with it, banked apart from untuned banks."""
    from editkit.bank.store import Bank

    scenario = write_scenario(tmp_path, train_size=40, test_size=16)  # every class in each train split
    report = run_bench(BenchConfig(
        scenario=str(scenario), modes=("taujp",), methods=("task-arithmetic",), strategies=("ewc",),
        protocols="task", tune=1, recipe={"steps": 2}, bank_root=tmp_path / "banks", run_dir=tmp_path / "run",
        negation_grid=2, xi_grid=(0.0, 1.0), xi_samples=4)).report
    selection = report["selection"]
    assert selection["experiences"] == ["digits"] and selection["split"] == "val" and selection["trials"] == TRIALS
    for row, coefficient, default in (("taujp", "lam", 0.1), ("ewc", "ewc_lambda", 1.0)):
        entry = selection["rows"][row]
        assert entry["coefficient"] == coefficient and len(entry["trials"]) == len(entry["scores"]) == TRIALS
        assert {"lr": 1e-4, "coefficient": default} in entry["trials"]
        assert entry["chosen"] == entry["trials"][int(np.argmax(entry["scores"]))]
    chosen = selection["rows"]["taujp"]["chosen"]
    recipe = Bank(tmp_path / "banks" / "tuned" / "bench-mini-taujp").get("mnist").recipe
    assert (recipe["lr"], recipe["lam"]) == (pytest.approx(chosen["lr"]), pytest.approx(chosen["coefficient"]))
    ewc = selection["rows"]["ewc"]["chosen"]
    assert report["strategies"]["ewc"]["options"]["task"]["ewc_lambda"] == pytest.approx(ewc["coefficient"])
    assert len(list((tmp_path / "banks" / "tune").iterdir())) == TRIALS  # one bank root per trial, kept for a re-run
