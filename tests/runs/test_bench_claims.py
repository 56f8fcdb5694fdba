"""The bench's claims, judged on hand-written report rows: a difference within the margin is a tie, a larger
one is ahead or behind, and a tauJp variant is compared apart from the baselines, never counted as one."""

from __future__ import annotations

import pytest
from rich.console import Console

from editkit.errors import ConfigError
from editkit.runs.bench.claims import claims, verdict
from editkit.runs.bench.config import BenchConfig
from editkit.runs.bench.report import METHOD_LABELS
from editkit.runs.bench.repeats import (Repeat, aggregate, mean_rows, order_repeats, repeat_bank_root, seed_repeats,
                                        spread)
from editkit.runs.bench.tables import claims_table

MARGIN = 0.005  # 0.5 points


def row(method: str, mode: str | None, coefficient: str | None, absolute: float, normalized: float | None,
        alpha: float | None = 1.0, adapter: str | None = None) -> dict:
    return {"method": method, "label": METHOD_LABELS[method], "mode": mode,
            "variant": f"{mode}-{adapter}" if adapter else mode, "coefficient": coefficient,
            "alpha": alpha, "absolute": absolute, "normalized": normalized, "per_task": {"a": absolute}}


def rows(*, baseline: tuple[float, float], variant: tuple[float, float]) -> list[dict]:
    """tauJp at alpha = 1 scores 0.7940 / 0.9624; the best baseline and the taujp-nonlinear variant as given."""
    return [
        row("pretrained", None, None, 0.40, None, alpha=None),
        row("task-arithmetic", "nonlinear", "1.0", 0.60, 0.70),
        row("task-arithmetic", "nonlinear", "tuned", 0.65, 0.75, alpha=0.3),
        row("ties", "linear", "tuned", *baseline, alpha=0.8),
        row("task-arithmetic", "taujp", "1.0", 0.7940, 0.9624),
        row("task-arithmetic", "taujp", "tuned", 0.7900, 0.9600, alpha=0.9),
        row("task-arithmetic", "taujp-nonlinear", "tuned", *variant, alpha=0.55),
    ]


def test_a_difference_within_the_margin_is_a_tie_and_a_larger_one_is_not():
    assert verdict(0.9624 - 0.9615, MARGIN) == "tie"  # the 0.09-point difference once reported as a loss
    assert verdict(-0.0009, MARGIN) == "tie"
    assert verdict(MARGIN, MARGIN) == verdict(-MARGIN, MARGIN) == "tie"  # the margin's ends included
    assert verdict(0.01, MARGIN) == "ahead" and verdict(-0.01, MARGIN) == "behind"
    assert verdict(0.0009, 0.0) == "ahead"  # no margin: any difference counts


def test_one_point_over_the_best_baseline_is_ahead_and_a_0_09_point_variant_gap_a_tie():
    judged = claims(rows(baseline=(0.7840, 0.9524), variant=(0.7940, 0.9633)), MARGIN)
    assert judged["margin"] == MARGIN
    for key in ("absolute", "normalized"):
        against_baseline = judged["vs_baselines"][key]
        assert against_baseline["verdict"] == "ahead" and against_baseline["margin"] == MARGIN
        assert against_baseline["difference"] == pytest.approx(0.01)
        assert against_baseline["against"]["method"] == "ties" and against_baseline["against"]["mode"] == "linear"
    variant = judged["vs_variants"]["normalized"]
    assert variant["verdict"] == "tie" and variant["difference"] == pytest.approx(-0.0009)
    assert variant["against"]["mode"] == "taujp-nonlinear"


def test_a_variant_one_point_above_is_behind_among_variants_and_no_baseline():
    judged = claims(rows(baseline=(0.7000, 0.9000), variant=(0.8040, 0.9724)), MARGIN)
    assert {r["mode"] for r in judged["baselines"]} == {None, "nonlinear", "linear"}
    assert {r["mode"] for r in judged["variants"]} == {"taujp", "taujp-nonlinear"}
    assert all(c["verdict"] == "ahead" for c in judged["vs_baselines"].values())
    assert all(c["verdict"] == "behind" for c in judged["vs_variants"].values())


def test_adapter_rows_join_the_baselines_or_the_variants_by_their_mode():
    """A bench of full and LoRA streams: the first tauJp alpha = 1 row is the claim's; a plain-LoRA row is a
    baseline, an L-LoRA tauJp row a variant."""
    judged = claims(rows(baseline=(0.70, 0.90), variant=(0.70, 0.90)) + [
        row("task-arithmetic", "taujp", "1.0", 0.77, 0.967, adapter="lora"),
        row("task-arithmetic", "nonlinear", "tuned", 0.81, 0.95, alpha=0.4, adapter="lora"),
        row("task-arithmetic", "taujp", "tuned", 0.80, 0.97, alpha=0.9, adapter="lora")], MARGIN)
    assert judged["taujp_alpha1"]["variant"] == "taujp" and judged["taujp_alpha1"]["absolute"] == 0.7940
    best = judged["vs_baselines"]["absolute"]
    assert best["against"]["variant"] == "nonlinear-lora" and best["verdict"] == "behind"
    assert best["difference"] == pytest.approx(0.7940 - 0.81)
    assert judged["vs_variants"]["normalized"]["against"]["variant"] == "taujp-lora"


def test_one_point_under_the_best_baseline_is_behind_and_pretrained_has_no_normalized_claim():
    judged = claims([row("pretrained", None, None, 0.8040, None, alpha=None),
                     row("task-arithmetic", "taujp", "1.0", 0.7940, 0.9624)], MARGIN)
    assert judged["vs_baselines"]["absolute"]["verdict"] == "behind"
    assert judged["vs_baselines"]["normalized"] is None  # pretrained has no normalized accuracy
    assert judged["vs_variants"] == {"absolute": None, "normalized": None}


def test_no_taujp_row_no_claims():
    assert claims([r for r in rows(baseline=(0.7, 0.9), variant=(0.7, 0.9)) if r["mode"] != "taujp"], MARGIN) is None


def test_the_table_shows_each_verdict_with_its_difference_and_the_margin():
    report = {"claims": claims(rows(baseline=(0.7840, 0.9524), variant=(0.7940, 0.9633)), MARGIN)}
    console = Console(width=300, record=True)
    console.print(claims_table(report))
    text = console.export_text()
    assert "a difference within ±0.50 points is a tie" in " ".join(text.split())  # the title, wrapped
    lines = {tuple(c.strip() for c in line.strip().strip("│").split("│")) for line in text.splitlines()
             if line.count("│") >= 2}
    assert ("baseline", "absolute", "79.4", "78.4", "TIES-merging (linear, α=0.80)", "+1.00", "0.50", "ahead") in lines
    assert ("τJp variant", "normalized", "96.2", "96.3", "task arithmetic (taujp-nonlinear, α=0.55)", "-0.09", "0.50",
            "tie") in lines
    assert claims_table({"claims": None}) is None


@pytest.mark.parametrize("margin", [-0.001, 1.0, float("nan")])
def test_a_margin_outside_0_1_is_refused(margin):
    with pytest.raises(ConfigError, match="claim margin"):
        BenchConfig(claim_margin=margin).validated()


# --- over seeds: means, spreads and a margin of two standard errors ---------------------------------------------


def seed_rows(ours: float, baseline: float) -> list[dict]:
    """One seed's rows: tauJp at alpha = 1 and the one baseline, both with normalized = absolute + 0.1."""
    return [row("task-arithmetic", "taujp", "1.0", ours, ours + 0.1),
            row("ties", "linear", "tuned", baseline, baseline + 0.1, alpha=0.8)]


def test_spread_is_the_mean_and_sample_standard_deviation():
    numbers = spread([0.70, 0.74, 0.78])
    assert numbers["mean"] == pytest.approx(0.74) and numbers["std"] == pytest.approx(0.04)  # sqrt(0.0032 / 2)
    assert spread([0.7]) == {"mean": 0.7, "std": 0.0, "values": [0.7]}
    assert spread([0.7, None]) is None


def test_a_mean_lead_inside_two_standard_errors_is_a_tie_and_outside_it_a_lead():
    # differences +3, -1, +1 points: mean +1, sample std 2, standard error 2 / sqrt(3) = 1.155 -> margin 2.31 points
    noisy = [seed_rows(0.80, 0.77), seed_rows(0.78, 0.79), seed_rows(0.80, 0.79)]
    judged = claims(mean_rows(noisy), MARGIN, noisy)
    comparison = judged["vs_baselines"]["absolute"]
    assert comparison["difference"] == pytest.approx(0.01)
    assert comparison["differences"] == pytest.approx([0.03, -0.01, 0.01])
    assert comparison["standard_error"] == pytest.approx(0.02 / 3 ** 0.5)
    assert comparison["margin"] == pytest.approx(2 * 0.02 / 3 ** 0.5) and comparison["verdict"] == "tie"
    assert judged["repeats"] == 3 and judged["margin"] == MARGIN
    # the same 1-point mean lead, every seed alike: the spread is 0 and the fixed margin rules: ahead
    steady = [seed_rows(0.80, 0.79)] * 3
    comparison = claims(mean_rows(steady), MARGIN, steady)["vs_baselines"]["absolute"]
    assert comparison["standard_error"] == 0.0 and comparison["margin"] == MARGIN and comparison["verdict"] == "ahead"


def test_mean_rows_keep_every_seeds_numbers_and_the_tuned_alphas():
    per_seed = [seed_rows(0.80, 0.70), seed_rows(0.70, 0.72)]
    per_seed[1][1]["alpha"] = 0.6
    rows = mean_rows(per_seed)
    assert rows[0]["absolute"] == pytest.approx(0.75) and rows[0]["spread"]["absolute"]["values"] == [0.80, 0.70]
    assert rows[0]["spread"]["normalized"]["mean"] == pytest.approx(0.85)
    assert rows[1]["alphas"] == [0.8, 0.6] and rows[1]["alpha"] == pytest.approx(0.7)
    with pytest.raises(ConfigError, match="disagree on their rows"):
        mean_rows([seed_rows(0.8, 0.7), seed_rows(0.8, 0.7)[:1]])


def test_seeds_follow_the_recipe_seed_and_only_later_ones_get_banks_of_their_own(tmp_path):
    seeds = seed_repeats(4, 3, ["a", "b"])
    assert [(r.name, r.seed, r.order) for r in seeds] == [("seed-4", 4, ("a", "b")), ("seed-5", 5, ("a", "b")),
                                                         ("seed-6", 6, ("a", "b"))]
    assert repeat_bank_root(tmp_path, seeds[0], seeds[0]) == tmp_path
    assert repeat_bank_root(tmp_path, seeds[2], seeds[0]) == tmp_path / "seed-6"
    with pytest.raises(ConfigError, match="--seeds is a number of seeds, at least 1"):
        BenchConfig(seeds=0).validated()
    with pytest.raises(ConfigError, match="not both"):
        BenchConfig(seeds=2, orders=2).validated()


def test_orders_start_with_the_scenarios_and_never_repeat_one():
    orders = order_repeats(["a", "b", "c"], 6, seed=0)
    assert orders[0] == Repeat("order-0", 0, ("a", "b", "c"))
    assert sorted(r.order for r in orders) == sorted({r.order for r in orders})  # all 3! orders, each once
    assert len(orders) == 6 and all(r.seed == 0 for r in orders)
    assert [r.order for r in order_repeats(["a", "b", "c"], 3, seed=0)] == [r.order for r in orders[:3]]  # seeded
    with pytest.raises(ConfigError, match="3 tasks have only 6 orders"):
        order_repeats(["a", "b", "c"], 7, seed=0)
    with pytest.raises(ConfigError, match="--orders is a number of task orders, at least 1"):
        BenchConfig(orders=0).validated()


def test_the_seed_table_shows_mean_and_std_and_the_widened_margin():
    from editkit.runs.bench.tables import addition_table

    noisy = [seed_rows(0.80, 0.77), seed_rows(0.78, 0.79), seed_rows(0.80, 0.79)]
    reports = [{"scenario": "s", "backbone": "b", "tasks": [], "modes": [], "methods": [], "cost": {},
                "continual": {}, "addition": {"rows": rows}, "timings": {"total_seconds": 1.0}}
               for rows in noisy]
    report = aggregate(reports, seed_repeats(0, 3, ["a"]), "seeds", ["r0", "r1", "r2"], MARGIN)
    console = Console(width=300, record=True)
    console.print(addition_table(report))
    console.print(claims_table(report))
    text = console.export_text()
    assert "79.3 ± 1.2" in text and "78.3 ± 1.2" in text  # tauJp 80, 78, 80; TIES 77, 79, 79
    assert "means over 3 seeds" in " ".join(text.split()) and "mean ± std over seeds 0, 1, 2" in " ".join(text.split())
    assert any(cells[-3:] == ["+1.00", "2.31", "tie"] for cells in (
        [c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()))
