"""Rich tables of an ``editkit bench`` report (the CLI prints them; nothing is printed here).

Every number shown is read from the report dict, so the terminal and ``report.json`` agree.
"""

from __future__ import annotations

from typing import Any, Mapping

from rich.markup import escape
from rich.table import Table

from editkit.runs.bench.repeats import describe
from editkit.runs.bench.report import METHOD_LABELS
from editkit.merge.coefficients import NEGATION_RETAIN
from editkit.runs.report import pct


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _accuracy(row: Mapping[str, Any], key: str) -> str:
    """The row's accuracy in %, as ``mean ± std`` when it is a mean over seeds or task orders."""
    numbers = row.get("spread", {}).get(key)
    return pct(row.get(key)) if numbers is None else f"{pct(numbers['mean'])} ± {pct(numbers['std'])}"


def addition_table(report: Mapping[str, Any]):
    tasks = report["tasks"]
    over = f", mean ± std over {describe(report)}" if "repeats" in report else ""
    table = Table(title=f"task addition — {report['scenario']} (test accuracy %, coefficients tuned on validation"
                        f"{over})", title_justify="left")
    for column in ("method", "mode", "coef"):
        table.add_column(column)
    for t in tasks:
        table.add_column(t, justify="right")
    table.add_column("absolute", justify="right", style="bold")
    table.add_column("normalized", justify="right", style="bold")
    table.add_column("class-IL", justify="right")
    table.caption = ("absolute / normalized: task-incremental (each task through its own head, the task id "
                     "given); class-IL: class-incremental, every input classified among every task's classes "
                     "without the task id (merged models: by the class statistics banked beside each vector, one "
                     "discriminant head; θ0: its own statistics; strategies: trained so, Avalanche's "
                     "IncrementalClassifier)")
    table.caption_justify = "left"
    previous = None
    for row in report["addition"]["rows"]:
        if previous is not None and row["variant"] != previous:
            table.add_section()
        previous = row["variant"]
        symbol = "λ" if row["method"] == "ties" else "α"
        if row["coefficient"] is None:
            coef = "—"
        elif row["coefficient"] == "tuned":
            coef = f"{symbol}={_num(row['alpha'])} (tuned)"
        else:
            coef = f"{symbol}={_num(row['alpha'])}"
        per_task = row["per_task"] or {}  # a strategy run under the class protocol alone has no task-IL scores
        table.add_row(row["label"], row["variant"] or "—", coef, *[pct(per_task.get(t)) for t in tasks],
                      _accuracy(row, "absolute"), _accuracy(row, "normalized"), _accuracy(row, "class_incremental"))
    return table


def negation_table(report: Mapping[str, Any]):
    first = next(iter(report["negation"].values()), {})
    retain, control = first.get("retain", NEGATION_RETAIN), first.get("control", "other tasks")
    table = Table(title=f"task negation θ0 − α·τ (test accuracy %; target ↓, control ↑ on {control}; tuned α keeps "
                        f"validation control ≥ {100 * retain:.0f}% of θ0's)", title_justify="left")
    for column in ("mode", "task", "θ0 target", "θ0 control", "α=1 target", "α=1 control", "tuned α",
                   "tuned target", "tuned control"):
        table.add_column(column, justify="left" if column in ("mode", "task") else "right")
    for mode, neg in report["negation"].items():
        for row in neg["rows"]:
            table.add_row(mode, row["task"], pct(row["pretrained"]["target"]), pct(row["pretrained"]["control"]),
                          pct(row["alpha1"]["target"]), pct(row["alpha1"]["control"]), _num(row["tuned"]["alpha"]),
                          pct(row["tuned"]["target"]), pct(row["tuned"]["control"]))
        m = neg["mean"]
        table.add_row(mode, "[bold]mean[/bold]", pct(m["pretrained"]["target"]), pct(m["pretrained"]["control"]),
                      pct(m["alpha1"]["target"]), pct(m["alpha1"]["control"]), "",
                      pct(m["tuned"]["target"]), pct(m["tuned"]["control"]), end_section=True)
    at_top = [f"{mode} {row['task']}" for mode, neg in report["negation"].items() for row in neg["rows"]
              if row["tuned"]["alpha"] is not None and row["tuned"]["alpha"] == max(neg["alphas"])]
    if at_top:
        top = max(report["negation_grid"])
        table.caption = (f"tuned α is the grid's top ({top:g}) for {', '.join(at_top)}: a larger α may forget more "
                         f"within the control budget (--negation-max {2 * top:g})")
        table.caption_justify = "left"
    return table


def taujp_table(report: Mapping[str, Any]):
    taujp = report["taujp"]
    table = Table(title=escape("τJp matrix M[a][b] = mean over test inputs of task b of ‖J f(x_b)·τ_a‖"),
                  title_justify="left")
    table.add_column("mode")
    table.add_column("τ_a")
    for t in taujp["tasks"]:
        table.add_column(t, justify="right")
    table.add_column("mean off-diag", justify="right")
    table.add_column("merged normalized (α=1)", justify="right")
    summary = {p["mode"]: p for p in taujp["per_method"]}
    for mode, matrix in taujp["matrices"].items():
        for a, (task, row) in enumerate(zip(taujp["tasks"], matrix)):
            last = a == len(matrix) - 1
            extra = (_num(summary[mode]["mean_off_diagonal"], 3), pct(summary[mode]["normalized"])) if a == 0 else ("", "")
            table.add_row(mode if a == 0 else "", task, *[_num(v, 3) for v in row], *extra, end_section=last)
    corr = taujp["correlation"]
    table.caption = (f"pairs (mode × task pair): pearson r = {_num(corr['pearson'], 3)}, "
                     f"spearman ρ = {_num(corr['spearman'], 3)} (n = {corr['n']}) between off-diagonal τJp and "
                     "normalized accuracy of the pair's merge")
    table.caption_justify = "left"
    return table


def xi_table(report: Mapping[str, Any]):
    xi = report["xi"]
    grid = xi["grid"]
    table = Table(title=f"weight-disentanglement error ξ(α1, α2), pair {xi['pair'][0]} / {xi['pair'][1]}",
                  title_justify="left", min_width=60)
    table.caption = f"{xi['samples']} test inputs per task; 0 = disentangled, at most 2"
    table.caption_justify = "left"
    table.add_column("mode")
    table.add_column("mean ξ", justify="right")
    shown = [a for a in (0.5, 1.0, 2.0) if a in grid]
    for a in shown:
        table.add_column(f"ξ({a:g},{a:g})", justify="right")
    for mode, data in xi["modes"].items():
        values = [data["xi"][grid.index(a)][grid.index(a)] for a in shown]
        table.add_row(mode, _num(data["mean"], 3), *[_num(v, 3) for v in values])
    return table


def cost_table(report: Mapping[str, Any]):
    """Fine-tuning and merging cost per stream. "s/step" is fine-tune seconds over steps; "steady s/step" the
    median step after warm-up (setup and warm-up apart, in "setup s"), and "vs linear" its ratio to the linear
    stream's of the same adapter: a step's cost, without one-off work or a slow spell of the machine."""
    table = Table(title="cost (this machine; fine-tuning from the bank's per-step records)", title_justify="left")
    for column in ("mode", "fine-tune s", "steps", "s/step", "setup s", "steady s/step", "vs linear", "peak RSS MiB",
                   "merge s", "TIES merge s", "total s"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for label, c in report["cost"].items():
        table.add_row(label, _num(c["finetune_seconds"], 1), str(c["steps"]), _num(c["seconds_per_step"], 3),
                      _num(c.get("setup_seconds"), 1), _num(c.get("steady_seconds_per_step"), 3),
                      _num(c.get("steady_over_linear"), 2),
                      _num(c["peak_rss_mib"], 0), _num(c["merge_seconds"], 3), _num(c["ties_seconds"], 3),
                      _num(c["total_seconds"], 1))
    return table


def continual_table(report: Mapping[str, Any]):
    """Each stream's ACC, BWT and forgetting (the merged model after each step, a strategy's model after each
    experience; mean ± std over repeats), task-incremental and, beside, class-incremental."""
    over = f", mean ± std over {describe(report)}" if "repeats" in report else ""
    table = Table(title=f"continual learning — the model after each step (test accuracy %{over}; "
                        "BWT < 0 and forgetting > 0 are what the later tasks took away)", title_justify="left")
    sections = {"task-IL": report["continual"], "class-IL": report.get("continual_class_incremental") or {}}
    shown = {name: section for name, section in sections.items() if section}
    table.add_column("stream / strategy")
    for name in shown:
        for column in ("ACC", "BWT", "forgetting"):
            table.add_column(f"{name} {column}", justify="right")
    for label in dict.fromkeys(key for section in shown.values() for key in section):
        table.add_row(label, *[_continual(section.get(label), key) for section in shown.values()
                               for key in ("acc", "bwt", "forgetting")])
    return table


def _continual(numbers: Mapping[str, Any] | None, key: str) -> str:
    """One continual number in %, as ``mean ± std`` over repeats; "—" where the stream has none."""
    value = None if numbers is None else numbers[key]
    if isinstance(value, Mapping):
        return f"{pct(value['mean'])} ± {pct(value['std'])}"
    return pct(value)


def kept_table(report: Mapping[str, Any]):
    """What every row keeps of earlier tasks after the last one, in items and MiB (None for a report without it)."""
    if not report.get("kept"):
        return None
    table = Table(title="what each row keeps of earlier tasks (after the last task)", title_justify="left")
    for column in ("row", "kept", "items", "MiB"):
        table.add_column(column, justify="right" if column in ("items", "MiB") else "left")
    for label, kept in report["kept"].items():
        table.add_row(label, kept["what"], str(kept["items"]), _num(kept["mib"], 2))
    return table


def repeat_cost_table(report: Mapping[str, Any]):
    """A bench over seeds or task orders: each stream's fine-tuning cost as mean ± std over them."""
    table = Table(title=f"cost over {describe(report)} (this machine; mean ± std)",
                  title_justify="left")
    columns = {"fine-tune s": ("finetune_seconds", 1), "steady s/step": ("steady_seconds_per_step", 3),
               "vs linear": ("steady_over_linear", 2), "peak RSS MiB": ("peak_rss_mib", 0), "merge s": ("merge_seconds", 3)}
    table.add_column("mode")
    for column in columns:
        table.add_column(column, justify="right")
    for label, cost in report["cost"].items():
        cells = []
        for key, digits in columns.values():
            numbers = cost[key]
            cells.append("—" if numbers is None else f"{_num(numbers['mean'], digits)} ± {_num(numbers['std'], digits)}")
        table.add_row(label, *cells)
    return table


def strategy_cost_table(report: Mapping[str, Any]):
    """Each Avalanche strategy's training cost (None when the bench ran none): time and peak memory. A run read
    back from an earlier run's record is marked with its protocol: its numbers are that run's, perhaps another
    machine's."""
    if not report.get("strategy_cost"):
        return None
    costs = report["strategy_cost"]
    recorded = any(c.get("recorded") for c in costs.values())
    table = Table(title="cost of the Avalanche strategies (this machine)", title_justify="left",
                  caption="recorded: read back from an earlier run's record, its seconds and memory that run's"
                  if recorded else None, caption_justify="left")
    for column in ("strategy", "train s", "steps", "s/step", "peak RSS MiB"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for name, c in costs.items():
        marked = f"{name} (recorded: {', '.join(c['recorded'])})" if c.get("recorded") else name
        table.add_row(marked, _num(c["train_seconds"], 1), str(c["steps"]), _num(c["seconds_per_step"], 3),
                      _num(c["peak_rss_mib"], 0))
    return table


def claims_table(report: Mapping[str, Any]):
    """Each claim's two numbers, their difference and its verdict, in points, with the margin that makes a tie;
    None when the report has no tauJp row to judge."""
    claims = report.get("claims")
    if not claims:
        return None
    margin = 100 * claims["margin"]
    repeats = claims.get("repeats")
    over = (f"means over {repeats} {claims.get('over', 'runs')}; a difference within the larger of ±{margin:.2f} "
            "points and two standard errors is a tie" if repeats else f"a difference within ±{margin:.2f} points is a tie")
    table = Table(title=f"claims: τJp task arithmetic at α=1 vs the best at its tuned coefficient (test accuracy %; "
                        f"{over})", title_justify="left")
    for column in ("against", "accuracy", "τJp α=1", "best", "which", "difference", "± margin", "verdict"):
        table.add_column(column, justify="right" if column in ("τJp α=1", "best", "difference", "± margin") else "left")
    ours = claims["taujp_alpha1"]
    groups = {"rehearsal_free": "strategy, rehearsal-free", "rehearsal": "strategy, rehearsal", "joint": "joint training"}
    against_strategies = [(groups[g], c) for g, c in claims.get("vs_strategies", {}).items()]
    for against, comparisons in (("baseline", claims["vs_baselines"]), ("τJp variant", claims["vs_variants"]),
                                 *against_strategies):
        for key, comparison in comparisons.items():
            if comparison is None:
                continue
            best = comparison["against"]
            table.add_row(against, key, pct(ours[key]), pct(best[key]), _which(best),
                          f"{100 * comparison['difference']:+.2f}", f"{100 * comparison['margin']:.2f}",
                          comparison["verdict"])
    return table


def _which(row: Mapping[str, Any]) -> str:
    """A report row's method, with its stream (mode, or mode-lora) and coefficient when it has them."""
    label = METHOD_LABELS[row["method"]]
    return label + (f" ({row['variant']}, α={_num(row['alpha'])})" if row["variant"] else "")
