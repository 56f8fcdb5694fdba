"""``editkit bench --ray``: on a local Ray cluster the same rows as one process, banks whole when a worker dies,
bad input refused before any work."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.errors import ConfigError, MissingResourceError
from editkit.runs.bench.cluster import Unit, connect, run_units
from editkit.runs.bench.config import BenchConfig
from editkit.runs.bench.run import run_bench
from editkit.util.progress import NullProgress
from helpers.scenarios import write_scenario

ray = pytest.importorskip("ray")
runner = CliRunner()
STEPS = 4


@pytest.fixture(scope="module")
def cluster():
    # one GPU as a logical resource (none is there): enough to place GPU units, which here compute nothing on it
    ray.init(num_cpus=2, num_gpus=1, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    yield
    ray.shutdown()


def _config(root, scenario, run: str, **extra) -> BenchConfig:
    return BenchConfig(scenario=str(scenario), modes=("linear", "taujp"), methods=("task-arithmetic", "ties"),
                       strategies=("naive",), recipe={"steps": STEPS}, bank_root=root / f"banks-{run}",
                       run_dir=root / run, seeds=2, negation_grid=3, xi_grid=(0.0, 1.0), xi_samples=8, **extra)


def _numbers(report: dict) -> dict:
    """What a bench computes, without what it measured of time and memory."""
    return {"rows": report["addition"]["rows"], "continual": report["continual"],
            "strategies": {n: s["rows"] for n, s in report.get("strategies", {}).items()},
            "claims": report.get("claims")}


def test_a_missing_extra_and_an_unreachable_address_are_refused_in_one_line(tmp_path, monkeypatch):
    """Run first in this module, before its cluster starts: a bench never joins a cluster it was not asked for."""
    scenario = write_scenario(tmp_path)
    result = runner.invoke(app, ["bench", "--scenario", str(scenario), "--ray", "127.0.0.1:9", "--bank-root",
                                 str(tmp_path / "banks"), "--run-dir", str(tmp_path / "run"), "--steps", "1"])
    assert result.exit_code == 1 and "no Ray cluster answers there" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "banks").exists() and not (tmp_path / "run").exists()  # nothing started
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    with pytest.raises(MissingResourceError, match=r'--ray needs Ray, an optional extra: pip install -e "\.\[ray\]"'):
        connect("auto")
    with pytest.raises(ConfigError, match="--unit-cpus must be >= 1"):
        BenchConfig(unit_cpus=0).validated()


def test_units_never_outnumber_the_cluster_cpus(cluster):
    """Four one-CPU units of three seconds each on a two-CPU cluster: at no moment do more than two run (a unit's
    threads are its CPUs; more units than CPUs would oversubscribe the node and time every unit wrong)."""

    def timed(seconds: float) -> tuple[float, float]:  # local, so Ray ships it by value
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    spans = run_units([Unit(f"sleep {i}", timed, (3.0,), cpus=1) for i in range(4)], NullProgress())
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])  # an end before a start
    running = [sum(change for _, change in events[:i + 1]) for i in range(len(events))]
    assert max(running) == 2, spans


def test_a_unit_that_needs_others_starts_when_they_are_done_and_not_after_the_rest(cluster):
    """A repeat's evaluation needs its streams, not its strategies. With a CPU free, a unit that needs another waits
    for it and gets its result; and it starts as soon as that one is done, while a longer unit still runs."""

    def timed(seconds: float, *needed: tuple) -> tuple[float, float, tuple]:  # local, so Ray ships it by value
        start = time.time()
        time.sleep(seconds)
        return start, time.time(), needed

    first, then = run_units([Unit("a", timed, (2.0,)), Unit("c", timed, (0.5,), needs=(0,))], NullProgress())
    assert then[0] >= first[1] and then[2] == (first,)  # a CPU was free, yet it waited, and it was handed a's result
    first, long, then = run_units([Unit("a", timed, (1.0,)), Unit("b", timed, (8.0,)),
                                   Unit("c", timed, (0.5,), needs=(0,))], NullProgress())
    assert first[1] <= then[0] and then[1] < long[1]  # beside b, not after it


def test_a_gpu_unit_s_worker_runs_no_other_unit(cluster):
    """CUDA reads the devices a process may see once, and Ray may give a worker's next unit another GPU: each GPU
    unit runs in a worker of its own (four in turn on the one GPU, four processes), where CPU units share the
    workers (four on two CPUs, two processes at most)."""

    def pid() -> int:  # local, so Ray ships it by value
        return os.getpid()

    on_gpu = run_units([Unit(f"gpu {i}", pid, (), gpus=1.0) for i in range(4)], NullProgress())
    assert len(set(on_gpu)) == 4, on_gpu
    on_cpus = run_units([Unit(f"cpu {i}", pid, (), cpus=2) for i in range(4)], NullProgress())
    assert len(set(on_cpus)) <= 2, on_cpus


class _Watch:
    """The most bench units seen running at once: Ray titles a worker's process ``ray::<task name>`` while it
    runs a task (``ray::IDLE`` between tasks); the board actor and Ray's own agents are not units."""

    def __init__(self) -> None:
        self.peak, self.seen = 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            running = set()
            for process in psutil.process_iter(["cmdline"]):
                title = " ".join(process.info["cmdline"] or []).strip()
                if title.startswith("ray::") and not any(k in title for k in ("IDLE", "_Board", "Agent")):
                    running.add(title)
            if len(running) > self.peak:
                self.peak, self.seen = len(running), running
            time.sleep(0.05)

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_a_bench_on_ray_gives_the_rows_of_one_process(cluster, tmp_path):
    """Two seeds, two modes, a strategy: streams, strategy runs and evaluations as Ray units with 1 CPU each equal
    the plain bench run with one torch thread, row for row, in every repeat and in the means. A repeat's four
    units (two streams, the strategy under each protocol) wait for two CPUs, and no more than two run at once: a unit that blocks in ``ray.get`` (its board line) hands its
    CPU back, and Ray started a third unit on it (sleeping units do not show this; real ones did)."""
    scenario = write_scenario(tmp_path, train_size=48, test_size=24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = run_bench(_config(tmp_path, scenario, "plain")).report
    finally:
        torch.set_num_threads(threads)
    with _Watch() as watch:
        distributed = run_bench(_config(tmp_path, scenario, "ray", ray="auto")).report
    assert 1 < watch.peak <= 2, watch.seen
    assert _numbers(distributed) == _numbers(plain)
    for seed in ("seed-0", "seed-1"):
        one = json.loads((tmp_path / "plain" / seed / "report.json").read_text())
        other = json.loads((tmp_path / "ray" / seed / "report.json").read_text())
        assert _numbers(other) == _numbers(one)
        assert other["cost"]["taujp"]["trained_now"] == one["cost"]["taujp"]["trained_now"] == ["digits", "mnist"]
        for mode in ("linear", "taujp"):
            banks = [Bank(tmp_path / f"banks-{run}" / ("" if seed == "seed-0" else seed) / f"bench-mini-{mode}")
                     for run in ("plain", "ray")]
            assert all(torch.equal(banks[0].load(n)[k], banks[1].load(n)[k])
                       for n in banks[0].names() for k in banks[0].load(n))


@pytest.mark.slow
def test_a_killed_worker_is_rerun_and_resumes_from_its_bank(cluster, tmp_path):
    """The taujp stream's worker is killed once its bank holds the first vector; Ray runs the unit again, which
    resumes from that vector: the bank ends whole and bit for bit the one an uninterrupted run writes."""
    scenario = write_scenario(tmp_path, train_size=48, test_size=24)
    config = BenchConfig(scenario=str(scenario), modes=("taujp",), methods=("task-arithmetic",),
                         recipe={"steps": 12}, negation_grid=3, xi_grid=(0.0, 1.0), xi_samples=8)
    bank = tmp_path / "banks-killed" / "bench-mini-taujp"
    killed: list[int] = []

    def kill_once() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            if len(Bank(bank)) if Bank(bank).exists() else 0:
                for process in psutil.process_iter(["cmdline"]):
                    if "taujp stream" in " ".join(process.info["cmdline"] or []):
                        os.kill(process.pid, signal.SIGKILL)
                        killed.append(process.pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_once)
    watcher.start()
    run_bench(BenchConfig(**{**config.__dict__, "bank_root": tmp_path / "banks-killed", "run_dir": tmp_path / "k",
                             "ray": "auto"}))
    watcher.join()
    assert killed, "the stream's worker was never seen"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_bench(BenchConfig(**{**config.__dict__, "bank_root": tmp_path / "banks-whole", "run_dir": tmp_path / "w"}))
    finally:
        torch.set_num_threads(threads)
    whole = Bank(tmp_path / "banks-whole" / "bench-mini-taujp")
    resumed = Bank(bank)
    assert resumed.names() == whole.names() == ["digits", "mnist"] and resumed.verify() == []
    assert all(torch.equal(resumed.load(n)[k], whole.load(n)[k]) for n in whole.names() for k in whole.load(n))


@pytest.mark.slow
def test_tune_on_ray_runs_every_trial_as_a_unit_and_chooses_as_one_process(cluster, tmp_path):
    """--tune 1 --ray: tauJp's and EWC's nine trials each a unit of its own (one line each as it ends), the scores
    and choices those of the plain command with one torch thread, and the tuned bench's rows too."""
    from editkit.util.progress import NullProgress

    class Lines(NullProgress):
        def __init__(self) -> None:
            self.lines: list[str] = []

        def note(self, message: str) -> None:
            self.lines.append(message)

    scenario = write_scenario(tmp_path, train_size=40, test_size=16)

    def config(run: str, **extra) -> BenchConfig:
        return BenchConfig(scenario=str(scenario), modes=("taujp",), methods=("task-arithmetic",), strategies=("ewc",),
                           protocols="class", tune=1, recipe={"steps": 2}, bank_root=tmp_path / f"banks-{run}",
                           run_dir=tmp_path / run, negation_grid=2, xi_grid=(0.0, 1.0), xi_samples=4, **extra)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = run_bench(config("plain")).report
    finally:
        torch.set_num_threads(threads)
    lines = Lines()
    distributed = run_bench(config("ray", ray="auto"), progress=lines).report
    assert distributed["selection"] == plain["selection"]
    assert _numbers(distributed) == _numbers(plain)
    for row in ("taujp", "ewc"):
        done = [line for line in lines.lines if line.startswith(f"tune {row} trial ") and ": done on " in line]
        assert len(done) == 9, lines.lines
    assert len(list((tmp_path / "banks-ray" / "tune").iterdir())) == 9
