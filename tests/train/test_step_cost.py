"""``benchmarks/step_cost.py`` times the scenario's own penalty beside the paper's schedules: which recipe each of
its labels trains with, and what its FLOP count counts."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import TensorDataset

from editkit.core.batching import TensorBatching
from editkit.core.taujp import unlabeled_source
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime
from helpers.benchmarks import benchmark_script


def fields(recipe: Recipe) -> tuple:
    return str(recipe.mode), recipe.schedule, recipe.reg_batch_size, recipe.reg_within_batch


def test_the_scenarios_own_penalty_is_timed_beside_the_papers_schedules():
    own = Recipe(batch_size=32, schedule="mixed", reg_batch=8, reg_within_batch=True, steps=30)
    recipes = benchmark_script("step_cost").variants(own, None, 0.9)
    assert {label: fields(r) for label, r in recipes.items()} == {
        "nonlinear": ("nonlinear", "mixed", 8, True),  # penalty fields a plain step never reads
        "linear": ("linear", "mixed", 8, True),
        "taujp": ("taujp", "mixed", 8, True),
        "taujp_cyclic": ("taujp", "cyclic", 4, False),
        "taujp_strict": ("taujp", "strict", 4, False),
        "taujp_mixed": ("taujp", "mixed", 8, False),
        "taujp_nonlinear": ("taujp-nonlinear", "cyclic", 4, False),
        "taujp_kfac": ("taujp", "mixed", 8, True),  # the data-free penalty draws no reg rows: these do not apply
        "taujp_kfac_apart": ("taujp", "mixed", 8, True),
        "taujp_kfac_energy": ("taujp", "mixed", 8, True),
        "taujp_kfac_bf16": ("taujp", "mixed", 8, True),
        "taujp_from_sum": ("taujp", "mixed", 8, True),  # the scenario's penalty, beside earlier vectors
    }
    assert [label for label, r in recipes.items() if r.from_sum] == ["taujp_from_sum"]
    assert {label: (r.penalty, r.curvature_combine, r.curvature_energy, r.curvature_precision)
            for label, r in recipes.items() if r.penalty != "inputs"} == {
        "taujp_kfac": ("kfac", "sum", 1.0, "fp32"), "taujp_kfac_apart": ("kfac", "apart", 1.0, "fp32"),
        "taujp_kfac_energy": ("kfac", "sum", 0.9, "fp32"), "taujp_kfac_bf16": ("kfac", "sum", 1.0, "bf16")}
    assert all(r.steps == 30 and r.batch_size == 32 for r in recipes.values())
    assert fields(benchmark_script("step_cost").variants(own, 6, 0.9)["taujp_mixed"]) == ("taujp", "mixed", 6, False)


D, F, C, B, R = 5, 3, 2, 8, 2  # a bias-free linear backbone D -> F, a frozen head F -> C, batch B, R reg rows
BACKBONE, HEAD = 2 * D * F, 2 * F * C  # one product's FLOPs per row


def linear_tasks(n: int) -> SimpleNamespace:
    """A scenario as the script reads one: ``n`` tasks of 64 random examples over one linear backbone."""
    torch.manual_seed(0)
    tasks = [SimpleNamespace(name=f"t{i}", train=TensorDataset(torch.randn(64, D), torch.randint(0, C, (64,))))
             for i in range(n)]
    return SimpleNamespace(tasks=tasks, heads={t.name: nn.Linear(F, C, bias=False) for t in tasks}, generic=None,
                           backbone=SimpleNamespace(module=nn.Linear(D, F, bias=False), batching=TensorBatching()))


def recipe(mode: str, **penalty) -> Recipe:
    return Recipe(mode=mode, batch_size=B, steps=3, **penalty)


def test_flops_per_step_are_the_steps_matrix_products_counted_by_hand():
    """Each product costs 2 m n k. A plain step: the forward x W^T and the weight gradient g^T x (B D F each), the
    head's forward and its input gradient (B F C each). A linearized step's jvp runs three backbone products
    (theta_0's x W^T, the tangent x tau^T, and the input's zero tangent times W, which torch computes), then the
    weight gradient. The penalty's reg rows go through the backbone, not the head."""
    built = linear_tasks(1)
    sources = [unlabeled_source("other", TensorDataset(torch.randn(64, D), torch.zeros(64, dtype=torch.long)))]
    count = partial(benchmark_script("step_cost").count_flops, built, sources=sources, runtime=Runtime())
    assert count(recipe("nonlinear")) == B * (2 * BACKBONE + 2 * HEAD)
    assert count(recipe("linear")) == B * (4 * BACKBONE + 2 * HEAD)
    assert count(recipe("taujp", schedule="cyclic", reg_batch=R)) == (B + R) * 4 * BACKBONE + B * 2 * HEAD
    assert count(recipe("taujp", schedule="mixed", reg_batch=R, reg_within_batch=True)) == (
        B * 4 * BACKBONE + (B - R) * 2 * HEAD)
    # beside earlier vectors the task rows and the reg rows take a jvp each: the same products, apart
    assert count(recipe("taujp", schedule="cyclic", reg_batch=R, from_sum=True)) == (B + R) * 4 * BACKBONE + B * 2 * HEAD


def test_a_streams_flops_penalise_each_task_on_the_tasks_before_it():
    """Over two tasks (no generic source): the first has nothing to be penalised on, so its step is a linear one;
    the second carries the R reg rows of the first task's inputs."""
    stream = partial(benchmark_script("step_cost").stream_flops, linear_tasks(2), runtime=Runtime())
    linear = B * (4 * BACKBONE + 2 * HEAD)
    assert stream(recipe("linear")) == linear
    assert stream(recipe("taujp", schedule="cyclic", reg_batch=R)) == (linear + linear + R * 4 * BACKBONE) / 2


def test_a_depthwise_convolutions_backward_counts_per_group():
    """A depthwise 3x3 convolution over 4 channels of 5x5 (padding 1): each output value multiplies 9 pairs, so the
    forward is 2 * 4 * 25 * 9 FLOPs, and so is each gradient of the backward (weight, and input when asked for)."""
    conv = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
    forward = 2 * 4 * 25 * 9
    for input_grad in (False, True):
        x = torch.randn(1, 4, 5, 5, requires_grad=input_grad)
        with benchmark_script("step_cost").flop_counter() as counter:
            conv(x).sum().backward()
        assert counter.get_total_flops() == forward * (3 if input_grad else 2)
