"""Terminal rendering with rich: progress bars and result tables.

Used by the CLI and available to scripts; library modules never print.

Output reads the same in a terminal and in a log. Written to a pipe or a file, rich lays everything out
at 80 columns and cuts wide table cells ("ctrl p…"), and a live progress bar forced onto a log (as
``FORCE_COLOR`` does in CI) lands as thousands of carriage-return frames. So off a terminal, editkit's
consoles lay tables out at their full width (``COLUMNS``, when set, still wins), and progress is one
plain line per finished task.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from rich.console import Console, ConsoleDimensions
from rich.table import Table

from editkit.runs.report import pct

if TYPE_CHECKING:
    from rich.progress import Progress

    from editkit.runs.records import StepRecord
    from editkit.util.progress import ProgressTask

#: The width editkit's consoles lay out at off a terminal without ``COLUMNS``: wider than any table, so each
#: takes its natural width and no line is wrapped.
UNWRAPPED_WIDTH = 10_000


def curvature_summary(curvature: Mapping[str, object]) -> str:
    """A banked vector's curvature in a table cell: its layers, size and examples; "-" where it has none."""
    if not curvature:
        return "-"
    layers = sum(int(curvature.get(k, 0)) for k in ("kronecker_layers", "norm_layers", "diagonal_parameters"))
    return f"{layers} layers, {int(curvature['bytes']) / 2**20:.1f} MiB, {curvature['examples']} ex."


class LogConsole(Console):
    """A rich console that, off a terminal and without ``COLUMNS``, is :data:`UNWRAPPED_WIDTH` wide instead
    of rich's 80 columns (a terminal's own width is kept: there the terminal wraps what is wider)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or os.environ.get("COLUMNS", "").isdigit():
            return size
        return ConsoleDimensions(UNWRAPPED_WIDTH, size.height)


console = LogConsole(stderr=False)
err_console = LogConsole(stderr=True)


def redraws(target: Console) -> bool:
    """Whether a bar can be redrawn in place on ``target``: a notebook, or an interactive terminal that is
    one (rich takes a forced-colour log for a terminal; ``TTY_INTERACTIVE=0`` turns redrawing off anywhere)."""
    return target.is_jupyter or (target.is_interactive and target.file.isatty())


def _info(fields: Mapping[str, float]) -> str:
    """The training losses a task reports as it advances, as they are shown beside its progress."""
    return "  ".join(f"{k} {fields[k]:.4f}" for k in ("ce", "penalty") if k in fields)


class _RichTask:
    def __init__(self, progress: Progress, task_id) -> None:
        self.progress, self.task_id = progress, task_id

    def advance(self, n: int = 1, **fields: float) -> None:
        self.progress.update(self.task_id, advance=n, info=_info(fields))


class _CountedTask:
    """A task's progress kept for the one line printed when it finishes."""

    def __init__(self) -> None:
        self.done, self.info = 0, ""

    def advance(self, n: int = 1, **fields: float) -> None:
        self.done += n
        self.info = _info(fields)


class RichProgress:
    """``editkit.util.progress.Progress`` drawn as rich bars (one per training or evaluation pass) where they
    can be redrawn (:func:`redraws`), else as one line per finished pass."""

    def __init__(self, target: Console | None = None) -> None:
        self.console = target or console

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[ProgressTask]:
        if not redraws(self.console):
            with self._line(description, total) as counted:
                yield counted
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, console=self.console, transient=True) as progress:
            yield _RichTask(progress, progress.add_task(description, total=total, info=""))

    def note(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)

    @contextlib.contextmanager
    def _line(self, description: str, total: int) -> Iterator[_CountedTask]:
        counted, start = _CountedTask(), time.perf_counter()
        yield counted
        info = f"  {counted.info}" if counted.info else ""
        self.console.print(f"{description}: {counted.done}/{total} in {time.perf_counter() - start:.1f} s{info}",
                           markup=False, highlight=False)


def step_table(step: StepRecord, single: Mapping[str, float], *, perplexity: bool = False) -> Table:
    """One stream step: the merged model (alpha = 1) on every task seen so far.

    perplexity: the scores are test perplexities (language tasks), shown as numbers, without the
    normalized column (a ratio of perplexities is not the paper's normalized accuracy)."""
    merged = step.merged
    title = f"after {step.task} (step {step.step + 1})" + ("  [resumed from bank]" if step.resumed else "") + _cost(step)
    if perplexity:
        return accuracy_table(title + "  —  test perplexity", merged["per_task"], pretrained={step.task: step.pretrained},
                              fmt=_ppl)
    return accuracy_table(title, merged["per_task"], single={t: single[t] for t in merged["per_task"]},
                          summary={"absolute": merged["absolute"], "normalized": merged["normalized"]})


def _cost(step: StepRecord) -> str:
    """The step's fine-tuning cost: the median steady step (what one more step costs, as the bench's cost table
    reads it), or, for a bank written before steps were timed, seconds over steps."""
    steady = step.cost.steady_seconds_per_step
    if steady is not None:
        return f"  —  {steady:.3f} s/step (steady), {step.cost.train_seconds or 0:.1f} s fine-tuning"
    return f"  —  {step.cost.seconds_per_step or 0:.2f} s/step"


def accuracy_table(title: str, per_task: Mapping[str, float], single: Mapping[str, float] | None = None,
                   pretrained: Mapping[str, float] | None = None, summary: Mapping[str, float] | None = None,
                   fmt: Callable[[float | None], str] = pct) -> Table:
    """Per-task score rows (accuracy as percentages by default; ``fmt`` formats others) plus a summary row.

    The table is at least as wide as its title: rich wraps a title to its table's width, which in a log (no
    terminal to wrap it) broke one line into two mid-phrase."""
    table = Table(title=title, title_justify="left", min_width=len(title) + 4)
    table.add_column("task")
    columns = [("pretrained", pretrained), ("edited", per_task), ("single-task", single)]
    columns = [(name, values) for name, values in columns if values is not None]
    for name, _ in columns:
        table.add_column(name, justify="right")
    if single is not None:
        table.add_column("normalized", justify="right")
    for task in per_task:
        row = [task] + [fmt(values.get(task)) for _, values in columns]
        if single is not None:
            row.append(pct(per_task[task] / single[task] if single.get(task) else None))
        table.add_row(*row)
    if summary:
        table.caption = "  ".join(f"{k} {pct(v)}" for k, v in summary.items())
        table.caption_justify = "left"
        table.caption_style = "bold"
    return table


def _ppl(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:.1f}"


def _sampled(row: Mapping) -> tuple[str, str, str, str]:
    """A test row's toxic fraction (all prompts; prompts the scorer does not flag), mean score and distinct-2,
    blank where the row was not sampled."""
    if "toxic_fraction" not in row:
        return "", "", "", ""
    clean = row.get("after_clean_prompts")
    return (f"{row['toxic_fraction']:.3f}±{row['toxic_fraction_stderr']:.3f}",
            f"{clean['toxic_fraction']:.3f}±{clean['toxic_fraction_stderr']:.3f}" if clean else "",
            f"{row['mean_score']:.3f}", f"{row['distinct_2']:.3f}" if "distinct_2" in row else "")


def language_negation_table(report: Mapping) -> Table:
    """Validation grid (what alpha was chosen on) and the test rows of a language negation."""
    tuning = report.get("tuning")
    rule = (f"chosen alpha {report['alpha']:g} ({tuning['rule']} rule: control ppl <= {tuning['bound']:.2f}"
            f"{'' if tuning['met'] else ', NOT met by any alpha: best tried'})" if tuning else
            f"alpha {report['alpha']:g} (given)")
    table = Table(title=f"negate {report['vector']} ({report['mode']}, {report['backbone']}): {rule}",
                  caption="ppl: perplexity of control (clean, pooled; then each corpus) and target text; f_lin: "
                          "exact linearized-model "
                          "perplexities; sel.: ln(target ratio) / ln(control ratio) vs theta_0; toxic: fraction of "
                          "sampled continuations flagged, ± standard error (clean prompts: of the prompts the "
                          "scorer does not flag itself); score: mean toxicity score; dist-2: "
                          "distinct-2 of continuations of neutral prompts")
    corpora = list(report["rows"][0].get("controls", {})) if report["rows"] else []
    for column in ("split", "model", "ctrl ppl", " / ".join(corpora) or "per corpus", "tgt ppl", "f_lin ctrl/tgt",
                   "sel.", "toxic ± s.e.", "clean prompts", "score", "dist-2"):
        table.add_column(column, justify="left" if column in ("split", "model") else "right", no_wrap=True)
    if tuning:
        rows = [{"alpha": 0.0, **tuning["pretrained"]}, *tuning["grid"]]
        for row in rows:
            model = "theta_0" if row["alpha"] == 0 else f"-{row['alpha']:g} tau"
            marker = " ◀" if row["alpha"] == report["alpha"] else ""
            table.add_row("val", model + marker, _ppl(row["control"]), "", _ppl(row["target"]), "", "", "", "", "",
                          "")
    for row in report["rows"]:
        flin = (f"{_ppl(row['control_flin'])} / {_ppl(row['target_flin'])}" if "control_flin" in row else "")
        sel = "" if row["selectivity"] is None else f"{row['selectivity']:.1f}"
        each = " / ".join(_ppl(row["controls"][c]) for c in corpora) if "controls" in row else ""
        table.add_row("test", row["model"], _ppl(row["control"]), each, _ppl(row["target"]), flin, sel,
                      *_sampled(row))
    checks = report.get("checks")
    if checks:
        table.caption += "\n" + "; ".join(f"{name.replace('_', ' ')}: {'yes' if ok else 'NO'}"
                                           for name, ok in checks.items())
    return table


def language_bench_table(report: Mapping) -> Table:
    """The modes at their tuned alphas (test split), and the checks of tauJp against the others."""
    table = Table(title=f"{report['scenario']}: negation per mode at its tuned alpha (test)")
    for column in ("mode", "alpha", "ctrl ppl", "tgt ppl", "sel.", "toxic ± s.e.", "score", "< theta_0 - 2 s.e."):
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    for mode, row in report["comparison"]["per_mode"].items():
        sel = "–" if row["selectivity"] is None else f"{row['selectivity']:.1f}"
        table.add_row(mode, f"{row['alpha']:g}{'' if row['met'] else ' (not met)'}", _ppl(row["control"]),
                      _ppl(row["target"]), sel, f"{row['toxic_fraction']:.3f}±{row['toxic_fraction_stderr']:.3f}",
                      f"{row['mean_score']:.3f}", "yes" if row["below_theta0"] else "no")
    checks = report["comparison"]["checks"]
    if checks:
        table.caption = (f"tauJp target ppl / best other mode's = {checks['target_ratio']:.2f} "
                         f"(wanted >= {checks['target_ratio_wanted']}: {'met' if checks['target_ratio_met'] else 'NOT met'}); "
                         f"tauJp toxic fraction below theta_0's by > 2 s.e.: "
                         f"{'yes' if checks['toxicity_below_theta0'] else 'no'}; the lowest of the modes: "
                         f"{'yes' if checks['toxic_fraction_lowest'] else 'NO'} "
                         f"({checks['toxic_fraction_vs_best_other']:+.3f} vs the least toxic other mode)")
    return table


def generation_table(result: Mapping) -> Table:
    """``editkit generate``: each prompt with theta_0's and the edited model's continuations and scores."""
    from rich.markup import escape

    threshold = result["threshold"]

    def score(value: float) -> str:
        text = f"{value:.2f}"
        return f"[red]{text}[/red]" if value > threshold else text

    table = Table(title=f"theta_0 vs {escape(result['edited'])}  (seed {result['seed']}, {result['max_new_tokens']} new "
                        f"tokens; scorer {escape(result['scorer'])}, toxic above {threshold:g})", title_justify="left",
                  show_lines=True)
    for column, justify in (("prompt", "left"), ("theta_0", "left"), ("score", "right"), ("edited", "left"),
                            ("score ", "right")):
        table.add_column(column, justify=justify, overflow="fold")
    for row in result["rows"]:
        table.add_row(escape(row["prompt"]), escape(row["theta_0"]), score(row["theta_0_score"]),
                      escape(row["edited"]), score(row["edited_score"]))
    base, edited = result["theta_0"], result["edited_summary"]
    table.caption = (f"toxic fraction: theta_0 {base['toxic_fraction']:.2f} ± {base['toxic_fraction_stderr']:.2f}, "
                     f"edited {edited['toxic_fraction']:.2f} ± {edited['toxic_fraction_stderr']:.2f};  mean score: "
                     f"theta_0 {base['mean_score']:.3f}, edited {edited['mean_score']:.3f}  (n = {base['n']})")
    table.caption_justify = "left"
    return table


def prediction_table(title: str, predictions) -> Table:
    """``editkit predict``: one row per input and task, its predicted class and that class's probability."""
    from rich.markup import escape

    table = Table(title=escape(title), title_justify="left")
    for column, justify in (("input", "left"), ("task", "left"), ("predicted class", "left"),
                            ("probability", "right")):
        table.add_column(column, justify=justify, overflow="fold")
    for p in predictions:
        table.add_row(escape(p.input), escape(p.task), escape(p.predicted), f"{p.probability:.3f}")
    return table
