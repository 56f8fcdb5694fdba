"""The seq2seq backbone against the T5 model it wraps, finite differences and hand computations.

Ground truth: the transformers model's own logits (teacher-forced, with padded encoder and decoder
rows), central finite differences of theta for the linearized module's tangent, hand-made logits for
the label-token loss and teacher-forced accuracy, and finite differences of each unlabeled row alone
(no padding anywhere) for the tauJp penalty on first-step logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from editkit.core.batching import IGNORE_INDEX, Seq2SeqBatching
from editkit.core.linearize import LinearizedModel
from editkit.core.taujp import Regularizer, UnlabeledSource
from editkit.eval.accuracy import TeacherForcedScorer, label_tokens_correct
from editkit.eval.scorers import task_scorer
from editkit.models.blocks import ALL_BLOCKS
from editkit.models.seq2seq import TextToTextHead, label_token_loss, seq2seq_backbone
from editkit.train.loop import StepComputer
from helpers.models import t5

START = 0  # the tiny T5's decoder start token (its pad id, as in T5)


def rows(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 40, (n,), generator=g) for n in lengths]


def labelled_batch(seed: int = 0):
    """Three examples whose prompts and decoder inputs differ in length: both sides are padded."""
    encoder, decoder = rows((6, 3, 4), seed), rows((3, 1, 2), seed + 1)
    return Seq2SeqBatching().collate(list(zip(encoder, decoder)))


def kwargs(batch) -> dict[str, torch.Tensor]:
    return Seq2SeqBatching().arguments(batch)[1]


def test_batching_pads_both_sides_and_a_reg_batch_joins_with_its_decoder_padded():
    batching = Seq2SeqBatching(pad_id=0)
    task = batching.collate([(torch.tensor([5, 6, 1]), torch.tensor([0, 7])), (torch.tensor([8, 1]), torch.tensor([0]))])
    assert task.input_ids.tolist() == [[5, 6, 1], [8, 1, 0]] and task.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert task.decoder_input_ids.tolist() == [[0, 7], [0, 0]]
    assert task.decoder_attention_mask.tolist() == [[1, 1], [1, 0]]
    reg = batching.collate([(torch.tensor([9, 9, 9, 9, 1]), torch.tensor([0]))])
    both = batching.concat(task, [reg])
    assert both.input_ids.tolist() == [[5, 6, 1, 0, 0], [8, 1, 0, 0, 0], [9, 9, 9, 9, 1]]
    assert both.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batching.output_mask(both).tolist() == [[True, True], [True, False], [True, False]]
    assert batching.collate_labels([torch.tensor([7, 1]), torch.tensor([1])]).tolist() == [[7, 1], [1, IGNORE_INDEX]]


@pytest.mark.parametrize("blocks", [1, ALL_BLOCKS])
def test_module_gives_the_models_teacher_forced_logits_and_padding_changes_no_real_position(blocks):
    model = t5()
    backbone = seq2seq_backbone(model, None, trainable_blocks=blocks)
    batch = labelled_batch()
    with torch.no_grad():
        got = backbone.module(**kwargs(batch))
        want = model(**kwargs(batch)).logits
        torch.testing.assert_close(got, want)
        for i in range(len(batch)):
            s, t = int(batch.attention_mask[i].sum()), int(batch.decoder_attention_mask[i].sum())
            alone = model(input_ids=batch.input_ids[i : i + 1, :s], decoder_input_ids=batch.decoder_input_ids[i : i + 1, :t]).logits
            torch.testing.assert_close(got[i, :t], alone[0], rtol=1e-5, atol=1e-5)


def test_theta_is_the_last_decoder_blocks_under_the_models_own_names():
    model = t5()
    own = {id(p): n for n, p in model.named_parameters()}
    last = seq2seq_backbone(model, None, trainable_blocks=1).module
    names = [n for n, _ in last.named_parameters()]
    assert names and all(n.startswith(("decoder.block.2.", "decoder.final_layer_norm.")) for n in names)
    assert all(own[id(p)] == n for n, p in last.named_parameters())  # the model's tensors, under its names
    every = seq2seq_backbone(model, None, trainable_blocks=ALL_BLOCKS).module
    assert [n for n, _ in every.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert "shared.weight" in own.values()  # the embeddings (and the LM head tied to them) are theta too


def _central_difference(module, direction, eps, inputs) -> torch.Tensor:
    theta0 = {n: p.detach() for n, p in module.named_parameters()}

    def at(sign: float) -> torch.Tensor:
        return functional_call(module, {n: theta0[n] + sign * eps * direction[n] for n in theta0}, (), inputs)

    with torch.no_grad():
        return (at(1.0) - at(-1.0)) / (2 * eps)


def _direction(module, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in module.named_parameters()}


# T5's layer norm computes its variance in float32 even in a float64 model: a step of 1e-3 keeps that
# rounding divided by eps and the O(eps^2) truncation error both under the 1e-3 tolerance.
EPS, TOLERANCE = 1e-3, 1e-3


@pytest.mark.parametrize("blocks", [1, ALL_BLOCKS])
def test_linearized_tangent_matches_central_differences_with_attention_masks(blocks):
    backbone = seq2seq_backbone(t5().double(), None, trainable_blocks=blocks)
    inputs = kwargs(labelled_batch(seed=3))
    direction = _direction(backbone.module, seed=1)
    finite = _central_difference(backbone.module, direction, EPS, inputs)
    linear = LinearizedModel(backbone.module)
    linear.load_task_vector(direction)
    primal, tangent = linear.primal_and_tangent(**inputs)
    real = inputs["decoder_attention_mask"].bool()
    error = torch.linalg.vector_norm(tangent[real] - finite[real]) / torch.linalg.vector_norm(finite[real])
    assert error < TOLERANCE
    assert torch.linalg.vector_norm(finite[real]) > 1e-3  # the direction moves the logits: the check has teeth
    with torch.no_grad():
        torch.testing.assert_close(primal, backbone.module(**inputs))


# Hand-made logits over a 4-token vocabulary: argmax per position is the index of the 5.
LOGITS = torch.tensor([
    [[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]],   # argmax 0 1 2
    [[0, 0, 0, 5.0], [5.0, 0, 0, 0], [0, 5.0, 0, 0]],   # argmax 3 0 1
    [[0, 5.0, 0, 0], [0, 0, 0, 5.0], [0, 0, 5.0, 0]],   # argmax 1 3 2
])
LABELS = torch.tensor([
    [0, 1, 2],                          # every label token is the argmax: correct
    [3, 0, IGNORE_INDEX],               # the argmax at the padded position (1) is not looked at: correct
    [1, 2, IGNORE_INDEX],               # second token 2, argmax 3: wrong
])


def test_teacher_forced_accuracy_is_the_hand_count():
    assert label_tokens_correct(LOGITS, LABELS).tolist() == [True, True, False]
    scorer = task_scorer("cola", TextToTextHead(), [], Seq2SeqBatching())
    assert isinstance(scorer, TeacherForcedScorer)
    assert scorer.finish(*scorer.tally(LOGITS, LABELS).tolist()) == pytest.approx(2 / 3)


def test_label_token_loss_is_the_mean_over_real_label_tokens():
    # each real position: -log softmax of the label's logit; 5 at the label gives log(e^5 + 3) - 5, a 0 gives log(e^5 + 3)
    hit, miss = math.log(math.exp(5) + 3) - 5, math.log(math.exp(5) + 3)
    want = (3 * hit + 2 * hit + hit + miss) / 7  # rows 0, 1 (two real tokens) and 2 (one hit, one miss)
    assert float(label_token_loss(LOGITS, LABELS)) == pytest.approx(want, rel=1e-6)
    assert float(TextToTextHead().loss(TextToTextHead()(LOGITS), LABELS)) == pytest.approx(want, rel=1e-6)


def test_penalty_is_the_norm_of_first_step_logit_tangents_of_each_unlabeled_row_alone():
    backbone = seq2seq_backbone(t5().double(), None, trainable_blocks=ALL_BLOCKS)
    batching = backbone.batching
    prompts = rows((2, 5, 3), seed=7)  # reg rows of different lengths: their encoder side is padded too
    start = torch.tensor([START])
    reg = batching.collate([(p, start) for p in prompts])
    task = labelled_batch(seed=5)  # decoder inputs up to 3 long: every reg row's decoder gets two padded positions
    lam = 0.3
    direction = _direction(backbone.module, seed=2)

    linear = LinearizedModel(backbone.module)
    linear.load_task_vector(direction)
    source = UnlabeledSource("other", reg)
    computer = StepComputer(linear, backbone.head, Regularizer([source], lam=lam, batch_size=len(prompts)), batching)
    _, penalty = computer.features(task, [reg])

    norms = []
    for prompt in prompts:  # each row alone: no padding, the decoder reads the start token only
        alone = {"input_ids": prompt[None], "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
                 "decoder_input_ids": start[None], "decoder_attention_mask": torch.ones(1, 1, dtype=torch.long)}
        first_step = _central_difference(backbone.module, direction, EPS, alone)[0, 0]  # (V,)
        norms.append(torch.linalg.vector_norm(first_step))
    want = lam * torch.stack(norms).mean()
    assert float(penalty.detach()) == pytest.approx(float(want), rel=TOLERANCE)

    # the padded decoder positions of the reg rows do have tangents: counting them would change the penalty
    _, tangent = linear.primal_and_tangent(**kwargs(batching.concat(task, [reg])))
    unmasked = torch.linalg.vector_norm(tangent.detach()[len(task):].flatten(1), dim=1).mean()
    assert float(lam * unmasked) > 1.05 * float(want)
