"""Recipe precedence and arithmetic, unit by unit (the stream tests cover them only end to end).

Levels, lowest first: the scenario's ``[recipe]`` table, a task's own values
(``epochs`` / ``steps`` keys or an inline ``recipe = {...}``), then overrides
(the CLI's options). Expected step counts are computed by hand in the comments.
"""

from __future__ import annotations

import json

import pytest

from editkit.core.modes import Mode
from editkit.errors import ConfigError
from editkit.scenario.spec import parse_scenario, task_recipes
from editkit.train.recipe import Recipe, from_mapping, label_parts, recipe_differences


def scenario(recipe: dict, *tasks: dict):
    return parse_scenario({"name": "unit", "backbone": {"family": "efficientnet-lite0"},
                           "tasks": [{"name": f"t{i}", "source": "packaged:digits", **t} for i, t in enumerate(tasks)],
                           "recipe": recipe})


def test_each_level_beats_the_one_below_field_by_field():
    spec = scenario({"lr": 0.5, "batch_size": 16, "lam": 0.3},
                    {}, {"recipe": {"lr": 0.25}}, {"recipe": {"lr": 0.25, "lam": 0.0}})
    plain = task_recipes(spec)
    assert [plain[t].lr for t in ("t0", "t1", "t2")] == [0.5, 0.25, 0.25]
    assert [plain[t].lam for t in ("t0", "t1", "t2")] == [0.3, 0.3, 0.0]
    assert all(r.batch_size == 16 and r.seed == Recipe().seed for r in plain.values())  # untouched: defaults
    over = task_recipes(spec, lr=0.125, lam=None)  # None keeps
    assert [over[t].lr for t in ("t0", "t1", "t2")] == [0.125] * 3
    assert [over[t].lam for t in ("t0", "t1", "t2")] == [0.3, 0.3, 0.0]


def test_steps_clears_inherited_epochs_and_epochs_beat_steps():
    spec = scenario({"steps": 7}, {"epochs": 2}, {}, {"steps": 3})
    plain = task_recipes(spec)
    assert (plain["t0"].steps, plain["t0"].epochs) == (7, 2)  # epochs recorded; steps fixed later by resolved()
    assert (plain["t1"].steps, plain["t1"].epochs) == (7, None)
    assert (plain["t2"].steps, plain["t2"].epochs) == (3, None)
    by_steps = task_recipes(spec, steps=5)  # --steps 5 beats per-task epochs
    assert {(r.steps, r.epochs) for r in by_steps.values()} == {(5, None)}
    by_epochs = task_recipes(spec, epochs=1.5)  # --epochs beats both
    assert {r.epochs for r in by_epochs.values()} == {1.5}
    # a task's epochs beat the scenario table's steps, whatever the table says
    assert scenario({"epochs": 4}, {"steps": 9}).recipe.epochs == 4
    assert task_recipes(scenario({"epochs": 4}, {"steps": 9}))["t0"].epochs is None


def test_resolved_turns_epochs_into_steps_by_hand():
    # 1000 examples, 32 x 2 per step: ceil(1000 / 64) = 16 steps per epoch
    recipe = Recipe(batch_size=32, accumulation=2, epochs=2.5, warmup=0.1)
    assert recipe.examples_per_step() == 64 and recipe.steps_per_epoch(1000) == 16
    resolved = recipe.resolved(1000)
    assert resolved.steps == 40 and resolved.epochs == 2.5  # 2.5 x 16
    assert resolved.warmup_steps == 4  # round(0.1 x 40)
    assert Recipe(batch_size=32, epochs=1 / 3).resolved(100).steps == 2  # ceil(1/3 x ceil(100/32) = 4/3)
    assert Recipe(batch_size=32, epochs=0.01).resolved(10).steps == 1  # never fewer than one step
    assert Recipe(batch_size=32, epochs=3).resolved(96).steps == 9  # exact: 3 x 3, no float round-up
    fixed = Recipe(steps=11)
    assert fixed.resolved(10_000) is fixed  # without epochs: the recipe itself
    assert Recipe(warmup=5, steps=11).warmup_steps == 5  # >= 1: a number of steps


def test_an_epoch_is_a_pass_over_the_labelled_rows_when_reg_rows_take_places_in_the_batch():
    import torch

    from editkit.core.taujp import UnlabeledSource

    sources = [UnlabeledSource(name, torch.zeros(10, 3)) for name in ("a", "b")]
    plain = Recipe(batch_size=32, epochs=2, mode="taujp", schedule="mixed", reg_batch=8)
    beside = plain.regularizer(sources)  # 8 reg rows a step, beside the batch: 32 labelled rows
    assert plain.resolved(96, beside).steps == 6  # 2 x ceil(96 / 32)
    within = plain.with_overrides(reg_within_batch=True)
    assert within.examples_per_step(within.regularizer(sources)) == 24  # 32 - 8
    assert within.resolved(96, within.regularizer(sources)).steps == 8  # 2 x ceil(96 / 24)
    four = plain.with_overrides(reg_within_batch=4)  # 28 labelled rows
    assert four.resolved(56, four.regularizer(sources)).steps == 4  # 2 x ceil(56 / 28), exact
    assert within.resolved(56, within.regularizer(sources)).steps == 6  # 2 x ceil(56 / 24 = 2.33)
    # strict draws 4 rows from each source: with 3 sources 12 within, 20 labelled
    strict = within.with_overrides(schedule="strict", reg_batch=4)
    three = [*sources, UnlabeledSource("c", torch.zeros(10, 3))]
    assert strict.resolved(96, strict.regularizer(three)).steps == 10  # 2 x ceil(96 / 20 = 4.8)
    # no penalty to draw (no source, or lam 0), or none given: the whole batch is labelled
    assert within.resolved(96, within.regularizer([])).steps == 6
    silent = within.with_overrides(lam=0.0)
    assert silent.resolved(96, silent.regularizer(sources)).steps == 6
    assert within.resolved(96).steps == 6


def test_an_adapter_run_trains_at_lora_lr_and_its_bank_records_that_step():
    recipe = Recipe(lr=1e-4, lora_lr=2e-3, adapter="lora", steps=7)
    resolved = recipe.resolved(100)
    assert resolved.lr == 2e-3 and resolved.lora_lr is None and resolved.steps == 7
    assert resolved.to_dict()["lr"] == 2e-3 and "lora_lr" not in resolved.to_dict()
    # what a bank recorded for an adapter run given --lr 2e-3 (before lora_lr existed) compares equal
    assert resolved.to_dict() == Recipe(lr=2e-3, adapter="lora", steps=7).resolved(100).to_dict()
    full = Recipe(lr=1e-4, lora_lr=2e-3)  # a full run ignores it, and its record does not carry it
    assert full.resolved(100).lr == 1e-4 and "lora_lr" not in full.to_dict()
    assert Recipe(lr=3e-4, adapter="lora").resolved(100).lr == 3e-4  # unset: lr
    with pytest.raises(ConfigError, match=r"recipe\.lora_lr must be > 0"):
        Recipe(lora_lr=0.0)


def test_a_label_splits_into_mode_and_adapter():
    for recipe in (Recipe(mode="taujp-nonlinear"), Recipe(mode="taujp-nonlinear", adapter="lora"), Recipe()):
        assert label_parts(recipe.label) == (recipe.mode.value, recipe.adapter)


def test_reg_batch_default_is_an_eighth_of_the_batch():
    assert Recipe(batch_size=32).reg_batch_size == 4
    assert Recipe(batch_size=5).reg_batch_size == 1
    assert Recipe(batch_size=32, reg_batch=9).reg_batch_size == 9


def test_reg_rows_within_the_batch_are_recorded_only_when_on_and_compared_only_with_the_penalty():
    """Banks written before the field existed trained with the reg rows beside the batch: they omit it, as a
    recipe with it off does, and compare equal; turned on, a penalized bank is from another recipe."""
    assert "reg_within_batch" not in Recipe().to_dict()
    assert Recipe(reg_within_batch=True).to_dict()["reg_within_batch"] is True
    assert recipe_differences(Recipe().to_dict(), Recipe(reg_within_batch=True).to_dict()) == ["reg_within_batch"]
    linear = Recipe(mode="linear")
    assert recipe_differences(linear.to_dict(), linear.with_overrides(reg_within_batch=True).to_dict()) == []


def test_a_count_of_reg_rows_within_the_batch_is_recorded_as_a_count_and_never_taken_for_the_flag():
    """true (every reg row) and a count of 1 are different recipes though Python has True == 1; 0 is none within,
    recorded as false is (omitted); a negative count or another type is refused by name."""
    assert Recipe(reg_within_batch=4).to_dict()["reg_within_batch"] == 4
    assert recipe_differences(Recipe(reg_within_batch=1).to_dict(), Recipe(reg_within_batch=True).to_dict()) == [
        "reg_within_batch"]
    assert recipe_differences(Recipe(reg_within_batch=4).to_dict(), Recipe(reg_within_batch=4).to_dict()) == []
    assert Recipe(reg_within_batch=0).reg_within_batch is False and "reg_within_batch" not in Recipe(
        reg_within_batch=0).to_dict()
    for bad in (-1, "4", 1.5):
        with pytest.raises(ConfigError, match=r"^recipe\.reg_within_batch must be true, false or a count of reg "
                                              r"rows >= 0, got "):
            Recipe(reg_within_batch=bad)


def test_reg_rows_within_the_batch_refuse_gradient_accumulation_only_where_a_penalty_draws_them():
    """The reg rows ride with a step's first micro-batch: the later ones would be short of rows for nothing, so a
    penalized recipe refuses the pair by name, and an unpenalized one (no reg rows) keeps both fields."""
    with pytest.raises(ConfigError, match=r"^recipe\.reg_within_batch: the reg rows ride with the first of a step's 2 "
                                          r"micro-batches only; set accumulation = 1 or reg_within_batch = false$"):
        Recipe(mode="taujp", reg_within_batch=True, accumulation=2)
    with pytest.raises(ConfigError, match="reg_within_batch"):
        Recipe(mode="linear", reg_within_batch=True, accumulation=2).with_overrides(mode="taujp")
    built = [Recipe(mode="linear", reg_within_batch=True, accumulation=2),
             Recipe(mode="taujp", lam=0.0, reg_within_batch=True, accumulation=2),
             Recipe(mode="taujp", reg_within_batch=True, accumulation=1),
             Recipe(mode="taujp", accumulation=2)]
    assert [r.regularized for r in built] == [False, False, True, True]


def test_mode_is_a_mode_and_serialises_as_its_string():
    recipe = Recipe().with_overrides(mode="linear")
    assert recipe.mode is Mode.LINEAR and recipe.to_dict()["mode"] == "linear"
    assert json.loads(json.dumps(recipe.to_dict()))["mode"] == "linear"
    assert Recipe(mode="taujp", lam=0.1).regularized and not Recipe(mode="taujp", lam=0).regularized
    assert not Recipe(mode="linear", lam=0.1).regularized
    assert "epochs" not in Recipe().to_dict() and Recipe(epochs=2).to_dict()["epochs"] == 2


def test_refusals_name_the_problem():
    with pytest.raises(ConfigError, match="not one of nonlinear, linear, taujp"):
        Recipe(mode="tangent")
    with pytest.raises(ConfigError, match=r"^recipe\.scope = 'both' is not one of seen, all$"):
        Recipe(scope="both")
    with pytest.raises(ConfigError, match=r"unknown recipe field\(s\) \['stepz'\]"):
        from_mapping({"stepz": 3})
    with pytest.raises(ConfigError, match="steps or epochs, not both"):
        from_mapping({"steps": 3, "epochs": 1})
    with pytest.raises(ConfigError, match="unknown recipe field"):
        scenario({}, {"recipe": {"lrr": 1}})


def test_a_bank_compares_the_penalty_fields_only_where_the_mode_has_the_penalty():
    """A scenario that changes its reg batch (offline-text: 4 -> 2) changes tauJp's vectors, not plain ones."""
    before, now = Recipe(reg_batch=4, lam=0.1), Recipe(reg_batch=2, lam=0.2)
    for mode in ("nonlinear", "linear", "sequential"):
        recorded = before.with_overrides(mode=mode).to_dict()
        assert recipe_differences(recorded, now.with_overrides(mode=mode).to_dict()) == []
        assert recipe_differences(recorded, now.with_overrides(mode=mode, lr=1e-3).to_dict()) == ["lr"]
    for mode in ("taujp", "taujp-nonlinear"):
        recorded = before.with_overrides(mode=mode).to_dict()
        assert recipe_differences(recorded, now.with_overrides(mode=mode).to_dict()) == ["lam", "reg_batch"]
    # another mode is a difference whatever else is, and a field one side lacks is one too
    assert recipe_differences(Recipe(mode="taujp").to_dict(), Recipe(mode="linear").to_dict()) == ["mode"]
    assert recipe_differences({**Recipe(mode="linear").to_dict(), "epochs": 2.0}, Recipe(mode="linear").to_dict()) == ["epochs"]
