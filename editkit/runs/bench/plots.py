"""PNG figures of a bench report (matplotlib, headless Agg backend).

Every function reads only the report dictionary, so figures can be redrawn
from a saved ``report.json``. Each figure is saved as ``<figure>.png`` (see :func:`render_all`).
"""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from editkit.runs.bench.repeats import describe
from editkit.runs.report import pyplot

#: Colour of each stream label (report keys): adapter streams in a lighter shade of their mode's.
MODE_COLORS = {"nonlinear": "tab:red", "linear": "tab:blue", "taujp": "tab:green",
               "nonlinear-lora": "lightcoral", "linear-lora": "lightskyblue", "taujp-lora": "yellowgreen"}
DPI = 110
METHOD_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))  # merge methods, in order


def _save(fig, path: Path, *, tight: bool = True) -> Path:
    """Write ``fig`` as a PNG and free it (``tight=False`` for figures with constrained layout)."""
    plt = pyplot()
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _color(mode: str) -> str:
    return MODE_COLORS.get(mode, "tab:gray")


def plot_alpha_curves(report: Mapping[str, Any], path: Path) -> Path:
    """Validation accuracy of each method vs its coefficient, one panel per mode; the chosen one marked."""
    plt = pyplot()
    modes = list(report["alpha_search"])
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.6), squeeze=False)
    pretrained = np.mean(list(report["pretrained"]["val"].values()))
    labels = {row["method"]: row["label"] for row in report["addition"]["rows"]}
    for ax, mode in zip(axes[0], modes):
        for (method, curve), style in zip(report["alpha_search"][mode].items(), cycle(METHOD_STYLES)):
            label = labels.get(method, method)
            ax.plot(curve["alphas"], curve["val_absolute"], linestyle=style, marker="o", markersize=3,
                    color=_color(mode), label=f"{label} (absolute)")
            ax.plot(curve["alphas"], curve["val_normalized"], linestyle=style, marker="s", markersize=3,
                    color=_color(mode), alpha=0.45, label=f"{label} (normalized)")
            best = curve["alphas"].index(curve["chosen"])
            ax.plot([curve["chosen"]], [curve["val_absolute"][best]], marker="*", markersize=14, color="black",
                    linestyle="none")
        ax.axhline(pretrained, color="gray", linestyle=":", linewidth=1, label="pretrained")
        ax.set(title=f"{mode}", xlabel="coefficient (α / λ)", ylabel="validation accuracy", ylim=(0, 1.05))
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{report['scenario']}: coefficient search on validation (★ chosen)")
    return _save(fig, path)


def plot_incremental(report: Mapping[str, Any], path: Path) -> Path:
    """Merged model (alpha = 1) after each stream step: absolute and normalized accuracy, one line per mode."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, stream in report["streams"].items():
        steps = list(range(1, len(stream["steps"]) + 1))
        left.plot(steps, [s["merged"]["absolute"] for s in stream["steps"]], marker="o", color=_color(mode), label=mode)
        right.plot(steps, [s["merged"]["normalized"] for s in stream["steps"]], marker="s", color=_color(mode), label=mode)
    ticks = list(range(1, len(report["tasks"]) + 1))
    for ax, what in ((left, "absolute"), (right, "normalized")):
        ax.set(title=f"merged model, α = 1: {what} accuracy", xlabel="tasks seen", ylabel=f"{what} accuracy",
               ylim=(0, 1.05), xticks=ticks)
        ax.set_xticklabels([f"{i}\n{t}" for i, t in zip(ticks, report["tasks"])], fontsize=8)
        ax.legend()
    fig.suptitle(f"{report['scenario']}: incremental stream")
    return _save(fig, path)


def plot_taujp_matrices(report: Mapping[str, Any], path: Path) -> Path:
    """tauJp matrix per mode on a shared colour scale."""
    plt = pyplot()
    taujp = report["taujp"]
    tasks, matrices = taujp["tasks"], taujp["matrices"]
    vmax = max(float(np.max(m)) for m in matrices.values()) or 1.0
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.0 * len(matrices) + 1.5, 4.0), squeeze=False,
                             constrained_layout=True)
    image = None
    for i, (ax, (mode, matrix)) in enumerate(zip(axes[0], matrices.items())):
        m = np.asarray(matrix)
        image = ax.imshow(m, cmap="viridis", vmin=0, vmax=vmax)
        for a in range(len(tasks)):
            for b in range(len(tasks)):
                ax.text(b, a, f"{m[a, b]:.2g}", ha="center", va="center", fontsize=7,
                        color="white" if m[a, b] < vmax / 2 else "black")
        ax.set(title=mode, xticks=range(len(tasks)), yticks=range(len(tasks)), xlabel="inputs of task b")
        ax.set_xticklabels(tasks, rotation=45, ha="right", fontsize=8)
        ax.set_yticklabels(tasks if i == 0 else [], fontsize=8)
        if i == 0:
            ax.set_ylabel("vector τ_a")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="mean ‖J f(x_b)·τ_a‖")
    fig.suptitle("τJp matrix (test inputs)")
    return _save(fig, path, tight=False)


def plot_correlation(report: Mapping[str, Any], path: Path) -> Path:
    """Off-diagonal tauJp of each task pair vs normalized accuracy of the pair's merge (alpha = 1)."""
    plt = pyplot()
    taujp = report["taujp"]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for mode in report["modes"]:
        points = [p for p in taujp["pairs"] if p["mode"] == mode]
        ax.scatter([p["taujp"] for p in points], [p["normalized"] for p in points], color=_color(mode), label=mode, s=30)
    for p in taujp["per_method"]:
        ax.scatter([p["mean_off_diagonal"]], [p["normalized"]], color=_color(p["mode"]), marker="*", s=160,
                   edgecolor="black", linewidth=0.6)
    corr = taujp["correlation"]
    r = "n/a" if corr["pearson"] is None else f"{corr['pearson']:.3f}"
    rho = "n/a" if corr["spearman"] is None else f"{corr['spearman']:.3f}"
    ax.set(xlabel="off-diagonal τJp of the pair ((M[a][b] + M[b][a]) / 2)", ylabel="normalized accuracy of τ_a + τ_b",
           title=f"τJp vs merged accuracy (dots: task pairs, ★: all tasks)\n"
                 f"pairs: pearson r = {r}, spearman ρ = {rho} (n = {corr['n']})")
    ax.legend()
    return _save(fig, path)


def plot_xi(report: Mapping[str, Any], path: Path) -> Path:
    """xi(alpha_1, alpha_2) heatmaps per mode, shared colour scale."""
    plt = pyplot()
    xi = report["xi"]
    grid = xi["grid"]
    modes = list(xi["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(4.0 * len(modes) + 1.5, 4.0), squeeze=False,
                             constrained_layout=True)
    image = None
    for ax, mode in zip(axes[0], modes):
        values = np.asarray(xi["modes"][mode]["xi"])
        image = ax.imshow(values.T, origin="lower", cmap="magma_r", vmin=0, vmax=max(1e-9, 2.0),
                          extent=(-0.5, len(grid) - 0.5, -0.5, len(grid) - 0.5))
        ax.set(title=f"{mode} (mean {np.mean(values):.3f})", xticks=range(len(grid)), yticks=range(len(grid)),
               xlabel=f"α1 ({xi['pair'][0]})", ylabel=f"α2 ({xi['pair'][1]})")
        ax.set_xticklabels([f"{a:g}" for a in grid], fontsize=7)
        ax.set_yticklabels([f"{a:g}" for a in grid], fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="ξ (disagreement, both tasks)")
    fig.suptitle(f"weight-disentanglement error ξ(α1, α2) ({xi['samples']} test inputs per task)")
    return _save(fig, path, tight=False)


def plot_negation(report: Mapping[str, Any], path: Path) -> Path:
    """Validation target and control accuracy vs alpha for each negated task, one panel per mode."""
    plt = pyplot()
    modes = list(report["negation"])
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        neg = report["negation"][mode]
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, row in enumerate(neg["rows"]):
            c = colors[i % len(colors)]
            ax.plot(neg["alphas"], row["val_target"], "-", color=c, label=f"{row['task']} target")
            ax.plot(neg["alphas"], row["val_control"], ":", color=c, label=f"{row['task']} control")
            if row["tuned"]["alpha"] is not None:
                ax.axvline(row["tuned"]["alpha"], color=c, linewidth=0.6, alpha=0.6)
        ax.set(title=mode, xlabel="α in θ0 − α·τ", ylabel="validation accuracy", ylim=(0, 1.05))
        ax.legend(fontsize=6)
    fig.suptitle(f"{report['scenario']}: negation (solid: target, dotted: control; lines: tuned α)")
    return _save(fig, path)


#: Accuracy matrices side by side before the figure wraps to another row (streams, strategies, merge methods).
MATRIX_COLUMNS = 4


def plot_accuracy_matrices(report: Mapping[str, Any], path: Path) -> Path:
    """Each stream's accuracy matrix: row t, the merged model after step t; column i, task i (blank before it
    is seen), with ACC, BWT and forgetting in the title."""
    plt = pyplot()
    continual = report["continual"]
    columns = min(len(continual), MATRIX_COLUMNS)
    rows = -(-len(continual) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns + 0.6, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(continual):]:
        ax.set_axis_off()
    for ax, (label, numbers) in zip(axes.flat, continual.items()):
        tasks = numbers["tasks"]
        grid = np.array([[np.nan if v is None else v for v in row] for row in numbers["matrix"]])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        for (t, i), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(i, t, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if value < 0.6 else "black")
        ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
        steps = [f"after {t}" for t in tasks] if len(grid) == len(tasks) else ["after all (joint)"]
        ax.set_yticks(range(len(grid)), steps, fontsize=7)
        bwt = "—" if numbers["bwt"] is None else f"{100 * numbers['bwt']:+.1f}"
        ax.set_title(f"{label}: ACC {100 * numbers['acc']:.1f}, BWT {bwt}", fontsize=9)
    fig.colorbar(image, ax=list(axes.flat), shrink=0.8, label="test accuracy")
    fig.suptitle(f"{report['scenario']}: accuracy after each step (streams and merge methods: merged at α = 1; "
                 "strategies: their model)")
    return _save(fig, path, tight=False)


def plot_spread(report: Mapping[str, Any], path: Path) -> Path:
    """A bench over seeds or task orders: each row the claims weigh (tauJp at alpha = 1, every method at its tuned coefficient)
    as its mean ± std, each run a cross, on absolute and normalized accuracy."""
    plt = pyplot()
    rows = [r for r in report["addition"]["rows"] if r["coefficient"] == "tuned"
            or (r["method"] == "task-arithmetic" and r["mode"] == "taujp" and r["coefficient"] == "1.0")]
    names = [f"{r['label']} ({r['variant']}, {'α=1' if r['coefficient'] == '1.0' else 'tuned'})" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.28 * len(rows) + 1.6), sharey=True)
    for ax, key in zip(axes, ("absolute", "normalized")):
        for y, row in enumerate(rows):
            numbers = row["spread"][key]
            ax.errorbar(numbers["mean"], y, xerr=numbers["std"], fmt="o", color=_color(row["variant"]), capsize=3)
            ax.plot(numbers["values"], [y] * len(numbers["values"]), "x", color="black", alpha=0.5, markersize=4)
        ax.set(title=f"{key} test accuracy", xlabel="mean ± std (× each run)")
    axes[0].set_yticks(range(len(rows)), names, fontsize=7)
    fig.suptitle(f"{report['scenario']}: {describe(report)}")
    return _save(fig, path)


#: The figures of a one-run bench report, each with the report section it draws (a repeat after the first has
#: no negation, taujp or xi section), and of one over seeds or task orders.
PAINTERS = {
    "alpha_curves": ("alpha_search", plot_alpha_curves),
    "incremental": ("streams", plot_incremental),
    "taujp_matrix": ("taujp", plot_taujp_matrices),
    "taujp_correlation": ("taujp", plot_correlation),
    "xi": ("xi", plot_xi),
    "negation": ("negation", plot_negation),
    "accuracy_matrix": ("continual", plot_accuracy_matrices),
}
REPEAT_PAINTERS = {"spread": ("repeats", plot_spread)}


def render_all(report: Mapping[str, Any], directory: Path) -> dict[str, str]:
    """Draw every figure whose section the report has into ``directory`` as ``<figure>.png``; {figure: file name}
    (relative to the run directory)."""
    painters = REPEAT_PAINTERS if "repeats" in report else PAINTERS
    out = {}
    for key, (section, painter) in painters.items():
        if section in report:
            out[key] = f"{key}.png"
            painter(report, Path(directory) / out[key])
    return out
