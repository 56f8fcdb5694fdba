"""``benchmarks/step_cost.py`` times the scenario's own penalty beside the paper's schedules: which recipe each of
its labels trains with."""

from __future__ import annotations

from editkit.train.recipe import Recipe
from helpers.benchmarks import benchmark_script


def fields(recipe: Recipe) -> tuple:
    return str(recipe.mode), recipe.schedule, recipe.reg_batch_size, recipe.reg_within_batch


def test_the_scenarios_own_penalty_is_timed_beside_the_papers_schedules():
    own = Recipe(batch_size=32, schedule="mixed", reg_batch=8, reg_within_batch=True, steps=30)
    recipes = benchmark_script("step_cost").variants(own, None)
    assert {label: fields(r) for label, r in recipes.items()} == {
        "nonlinear": ("nonlinear", "mixed", 8, True),  # penalty fields a plain step never reads
        "linear": ("linear", "mixed", 8, True),
        "taujp": ("taujp", "mixed", 8, True),
        "taujp_cyclic": ("taujp", "cyclic", 4, False),
        "taujp_strict": ("taujp", "strict", 4, False),
        "taujp_mixed": ("taujp", "mixed", 8, False),
        "taujp_nonlinear": ("taujp-nonlinear", "cyclic", 4, False),
    }
    assert all(r.steps == 30 and r.batch_size == 32 for r in recipes.values())
    assert fields(benchmark_script("step_cost").variants(own, 6)["taujp_mixed"]) == ("taujp", "mixed", 6, False)
