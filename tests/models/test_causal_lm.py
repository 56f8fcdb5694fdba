"""The causal-LM backbone's prefix / tail / head split against the whole model it was cut from.

Ground truth: the transformers model itself (its logits on a right-padded batch with an attention
mask), central finite differences of the tail's weights for the linearized tail's tangent, and the
model's own parameter objects for the names a task vector is written under. Models are tiny random
GPT-2 (untied head, learned positions) and Llama (tied head, rotary positions, grouped-query
attention), both on PyTorch's SDPA attention as loaded models are.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from editkit.core.linearize import LinearizedModel
from editkit.errors import ConfigError
from editkit.eval.lm_negation import edited_weights
from editkit.models.blocks import ALL_BLOCKS
from editkit.models.causal_lm import LanguageModelHead, causal_lm_backbone
from helpers import models
from helpers.tangents import central_difference, random_direction

LAYERS = 3
FAMILIES = {
    "gpt2": lambda: models.gpt2(n_layer=LAYERS, attn_implementation="sdpa"),
    "llama": lambda: models.llama(num_hidden_layers=LAYERS),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def lm(request):
    return FAMILIES[request.param]()


def padded_batch(seed: int = 0, lengths: tuple[int, ...] = (7, 4, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (pad id 0) and their attention mask: rows of different real lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 99, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def logits_through_the_split(backbone, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        hidden = backbone.prefix(ids, mask)
        return backbone.head(backbone.module(hidden, attention_mask=mask))


@pytest.mark.parametrize("blocks", [1, 2, ALL_BLOCKS])
def test_head_of_tail_of_prefix_is_the_full_models_logits_at_real_positions(lm, blocks):
    backbone = causal_lm_backbone(lm, None, trainable_blocks=blocks)
    ids, mask = padded_batch()
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=mask).logits
    got = logits_through_the_split(backbone, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_the_prefix_states_of_a_padded_row_are_those_of_the_row_alone(lm):
    """Right padding changes nothing at the real positions (what caching prefix states per batch relies on)."""
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1)
    ids, mask = padded_batch()
    batched = backbone.prefix(ids, mask)
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = backbone.prefix(ids[row : row + 1, :length], mask[row : row + 1, :length])
        torch.testing.assert_close(batched[row, :length], alone[0], rtol=1e-5, atol=1e-6)


# GPT-2 computes in float64 throughout, so a small step gives the derivative to ~1e-9. Llama's RMSNorm casts its
# input to float32 even in a float64 model (then back), which puts float32 rounding (~1e-7 relative) into every
# evaluation: a small step would divide that noise by eps, so the step is 1e-3 and the tolerance 1e-3
# (the O(eps^2) truncation error of a central difference and the float32 noise / eps are both below it).
TANGENT_CHECKS = {"gpt2": (1e-6, 1e-6), "llama": (1e-3, 1e-3)}


@pytest.mark.parametrize("family", sorted(TANGENT_CHECKS))
@pytest.mark.parametrize("blocks,head", [(2, False), (ALL_BLOCKS, False), (2, True)])
def test_linearized_tail_tangent_matches_central_differences_with_padding(family, blocks, head):
    eps, tolerance = TANGENT_CHECKS[family]
    lm = FAMILIES[family]().double()
    backbone = causal_lm_backbone(lm, None, trainable_blocks=blocks, trainable_head=head)
    ids, mask = padded_batch(seed=3)
    hidden = backbone.prefix(ids, mask)
    assert hidden.dtype == torch.float64
    direction = random_direction(backbone.module, seed=1)
    finite = central_difference(backbone.module, direction, eps, hidden, mask)

    linear = LinearizedModel(backbone.module)
    linear.load_task_vector(direction)
    primal, tangent = linear.primal_and_tangent(hidden, attention_mask=mask)
    real = mask.bool()
    error = torch.linalg.vector_norm(tangent[real] - finite[real]) / torch.linalg.vector_norm(finite[real])
    assert error < tolerance
    with torch.no_grad():
        torch.testing.assert_close(primal, backbone.module(hidden, attention_mask=mask))


def test_tail_parameters_carry_the_full_models_names(lm):
    backbone = causal_lm_backbone(lm, None, trainable_blocks=2)
    tail_names = [n for n, _ in backbone.module.named_parameters()]
    assert {n.split(".")[1] for n in tail_names if n.startswith("layers.")} == {"1", "2"}
    assert all(n.startswith(("layers.1.", "layers.2.", "norm.")) for n in tail_names)
    if lm.config.model_type == "llama":  # its blocks are model.layers.<i>: the tail's names are the model's own
        assert set(backbone.tail_parameters().values()) == {f"model.{n}" for n in tail_names}


def test_tail_parameters_map_to_the_full_models_tensors(lm):
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1)
    mapping = backbone.tail_parameters()
    tail = dict(backbone.module.named_parameters())
    assert set(mapping) == set(tail)
    for tail_name, full_name in mapping.items():
        assert lm.get_parameter(full_name) is tail[tail_name]
    last, norm = lm.base_model.get_submodule(_blocks_attr(lm))[-1], _final_norm(lm)
    expected = {id(p) for p in [*last.parameters(), *norm.parameters()]}
    assert {id(lm.get_parameter(f)) for f in mapping.values()} == expected  # nothing of the prefix, embeddings, head


def _blocks_attr(lm) -> str:
    return "layers" if lm.config.model_type == "llama" else "h"


def _final_norm(lm) -> nn.Module:
    return lm.base_model.norm if lm.config.model_type == "llama" else lm.base_model.ln_f


@pytest.mark.parametrize("bad", [0, LAYERS + 1, -1, "0", "x2", 1.5, True, "ALL", None])
def test_trainable_blocks_out_of_range_or_of_the_wrong_type_is_refused(lm, bad):
    with pytest.raises(ConfigError, match=f"trainable_blocks must be an integer in 1..{LAYERS} or 'all'"):
        causal_lm_backbone(lm, None, trainable_blocks=bad)


def test_trainable_blocks_given_as_text_is_a_count(lm):
    """The command line (--trainable-blocks 2) gives text."""
    assert causal_lm_backbone(lm, None, trainable_blocks="2").module.first == LAYERS - 2


def test_all_blocks_is_every_block(lm):
    backbone = causal_lm_backbone(lm, None, trainable_blocks=ALL_BLOCKS)
    assert backbone.module.first == 0 and len(backbone.module.layers) == LAYERS
    assert backbone.name.endswith(f"[tail {LAYERS}/{LAYERS}]")


def test_fingerprint_changes_when_a_prefix_weight_changes(lm):
    """The tail is the last block only: a vector banked on one prefix must not be applied over another."""
    edited = copy.deepcopy(lm)
    before = causal_lm_backbone(edited, None, trainable_blocks=1).fingerprint()
    assert causal_lm_backbone(copy.deepcopy(lm), None, trainable_blocks=1).fingerprint() == before
    first_block = edited.base_model.get_submodule(_blocks_attr(edited))[0]
    with torch.no_grad():
        next(first_block.parameters()).view(-1)[0] += 1e-3
    assert causal_lm_backbone(edited, None, trainable_blocks=1).fingerprint() != before


def test_lm_head_is_the_models_output_layer_and_refuses_a_bias(lm):
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1)
    hidden = torch.randn(2, 3, lm.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(backbone.head(hidden), lm.get_output_embeddings()(hidden))
    with pytest.raises(ConfigError, match="has a bias"):
        LanguageModelHead(nn.Linear(4, 5, bias=True))


def test_prefix_in_another_thread_never_disturbs_the_tail(lm):
    """A tauJp source computes prefix states in the loader thread while the main thread runs the tail through
    the same decoder blocks: neither thread's capturing hook may fire in the other's pass."""
    import threading

    backbone = causal_lm_backbone(lm, None, trainable_blocks=1)
    ids = torch.randint(0, lm.config.vocab_size, (3, 7))
    hidden = backbone.prefix(ids)
    expected = backbone.module(hidden)
    failures: list[BaseException] = []

    def prefixes() -> None:
        try:
            for _ in range(40):
                assert torch.equal(backbone.prefix(ids), hidden)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    worker = threading.Thread(target=prefixes)
    worker.start()
    for _ in range(40):
        assert torch.equal(backbone.module(hidden), expected)
    worker.join()
    assert not failures


# --------------------------------------------------------------------------- a trainable (untied) LM head


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_trainable_head_tail_outputs_the_full_models_logits(family):
    lm = FAMILIES[family]()
    ids, mask = padded_batch()
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=mask).logits
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1, trainable_head=True)
    assert backbone.feature_dim == lm.config.vocab_size and backbone.name.endswith("[tail 1/3 + head]")
    got = logits_through_the_split(backbone, ids, mask)  # the fixed head is now the identity
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_a_trainable_head_is_untied_from_the_input_embedding():
    """Llama's head is tied: editing the head must leave the embedding (the prefix, theta_0) as it was."""
    lm = FAMILIES["llama"]()
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    embedding = lm.get_input_embeddings().weight.detach().clone()
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1, trainable_head=True)
    head = lm.get_output_embeddings().weight
    assert head is not lm.get_input_embeddings().weight and not lm.config.tie_word_embeddings
    torch.testing.assert_close(head, embedding, rtol=0, atol=0)
    assert backbone.tail_parameters()["lm_head.weight"] == "lm_head.weight"
    assert backbone.module.lm_head.weight is head
    with torch.no_grad():
        head.add_(1.0)
    assert torch.equal(lm.get_input_embeddings().weight, embedding)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_head_vector_applied_to_the_whole_model_gives_the_tails_logits(family):
    """What sampling and --out use (the whole model, theta_0 + delta by full names) against the tail's own
    output at theta_0 + delta."""
    lm = FAMILIES[family]()
    backbone = causal_lm_backbone(lm, None, trainable_blocks=1, trainable_head=True)
    delta = random_direction(backbone.module, seed=2, scale=0.01)
    ids, mask = padded_batch(seed=4)
    hidden = backbone.prefix(ids, mask)
    with torch.no_grad():
        want = torch.func.functional_call(backbone.module, {n: p + delta[n] for n, p in
                                                            backbone.module.named_parameters()},
                                          (hidden,), {"attention_mask": mask})
        with edited_weights(backbone, delta) as edited:
            got = edited(input_ids=ids, attention_mask=mask).logits
        restored = lm(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[real], restored[real], atol=1e-3)  # the vector moved the logits, and was undone:
    torch.testing.assert_close(restored[real], backbone.module(hidden, attention_mask=mask)[real], rtol=1e-5,
                               atol=1e-5)
