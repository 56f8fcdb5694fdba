"""``Runtime(channels_last=True)``: the same training and scores up to float rounding, in NHWC kernels.

Ground truth: the default layout's run of the same seed. The option must reach the convolutions
(a forward pre-hook sees channels-last weights in every mode), and change the banked vectors by no
more than float rounding (their entries are about 3e-2 after five steps; rounding moves them by
about 1e-7).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editkit.core.batching import TensorBatching
from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.eval.accuracy import evaluate_vector
from editkit.eval.scorers import task_scorer
from editkit.models.heads import LinearHead
from editkit.train.loop import fine_tune
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime

MODES = ("nonlinear", "linear", "taujp", "taujp-nonlinear")


def network() -> nn.Module:
    """A MobileNet-like block: a full 3x3 convolution, a depthwise one, a pointwise one, BatchNorm."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                         nn.Conv2d(8, 6, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()


def task():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 12, 12, generator=g), torch.randint(0, 3, (64,), generator=g)
    head = LinearHead(torch.randn(3, 6, generator=g), torch.zeros(3))
    return TensorTaskDataset(x, y), head, UnlabeledSource("other", torch.randn(40, 3, 12, 12, generator=g), seed=0)


def train(mode: str, channels_last: bool, hook=None) -> dict[str, torch.Tensor]:
    data, head, source = task()
    module = network()
    if hook is not None:
        module[0].register_forward_pre_hook(hook)
    recipe = Recipe(mode=mode, steps=5, batch_size=16, lr=1e-2, warmup=0, reg_batch=4)
    return fine_tune(module, head, data, recipe, recipe.regularizer([source]),
                     runtime=Runtime(channels_last=channels_last)).task_vector


@pytest.mark.parametrize("mode", MODES)
def test_the_first_convolution_sees_channels_last_weights_only_when_asked(mode):
    seen: dict[bool, set[bool]] = {True: set(), False: set()}

    def recorder(channels_last: bool):
        def record(conv: nn.Conv2d, args) -> None:
            weight = conv.weight  # theta_0 + tau, or theta_0 carrying tau as its tangent
            seen[channels_last].add(weight.is_contiguous(memory_format=torch.channels_last)
                                    and not weight.is_contiguous())
        return record

    for channels_last in (True, False):
        train(mode, channels_last, recorder(channels_last))
    assert seen == {True: {True}, False: {False}}


@pytest.mark.parametrize("mode", MODES)
def test_channels_last_trains_the_default_layouts_vectors_up_to_float_rounding(mode):
    default, nhwc = train(mode, False), train(mode, True)
    assert default.keys() == nhwc.keys()
    for name in default:
        assert nhwc[name].is_contiguous()  # banks and callers get one layout whatever the runtime's
        torch.testing.assert_close(nhwc[name], default[name], rtol=0, atol=1e-6)
    assert max(v.abs().max() for v in default.values()) > 1e-2  # the tolerance is far below what training moved


@pytest.mark.parametrize("mode", ["nonlinear", "taujp"])
def test_channels_last_scores_what_the_default_layout_scores(mode):
    data, head, _ = task()
    tau = train(mode, False)
    scorer = task_scorer("t", head, data, TensorBatching())
    scores = {cl: evaluate_vector(network(), mode, tau, [scorer], runtime=Runtime(channels_last=cl))["t"]
              for cl in (False, True)}
    assert scores[True] == scores[False] and 0 < scores[False] < 1
