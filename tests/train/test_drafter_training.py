"""The drafter objective's pieces against plain loops, and the acceptance metric against the engine's API."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ddtree.errors import ConfigError
from ddtree.models import DFlashDrafter, TargetConfig, TargetModel
from ddtree.train.data import Continuations
from ddtree.train.drafter import (
    DrafterTrainConfig,
    block_acceptance,
    block_labels,
    depth_weights,
    drafter_loss,
    init_from_target,
    replay_chain,
    sample_anchors,
    target_features,
)


def test_anchors_are_distinct_sorted_and_inside_the_generated_part() -> None:
    anchors = sample_anchors(6, prompt_len=10, seq_len=40, count=12, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (6, 12)
    for row in anchors.tolist():
        assert row == sorted(set(row))
        assert all(9 <= a <= 38 for a in row)
    every = sample_anchors(2, prompt_len=10, seq_len=40, count=30, generator=torch.Generator())
    assert every.tolist() == [list(range(9, 39))] * 2
    with pytest.raises(ConfigError, match="anchors_per_row"):
        sample_anchors(1, prompt_len=10, seq_len=40, count=31, generator=torch.Generator())


def test_block_labels_match_a_plain_loop() -> None:
    ids = torch.randint(5, 100, (2, 20))
    anchors = torch.tensor([[0, 7, 15], [3, 10, 18]])
    labels, valid = block_labels(ids, anchors, block_size=5)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            for k in range(1, 5):
                if a + k < 20:
                    assert valid[b, j, k - 1] and labels[b, j, k - 1] == ids[b, a + k]
                else:
                    assert not valid[b, j, k - 1]


def test_weighted_loss_and_accuracy_match_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 3, 4), generator=gen)
    valid = torch.rand(2, 3, 4, generator=gen) > 0.3
    weights = depth_weights(5, 7.0)
    assert weights.tolist() == pytest.approx([math.exp(-k / 7.0) for k in range(4)])
    loss, acc = drafter_loss(logits, labels, valid, weights)
    num = den = 0.0
    hits, counts = [0] * 4, [0] * 4
    for b in range(2):
        for a in range(3):
            for k in range(4):
                if valid[b, a, k]:
                    ce = -F.log_softmax(logits[b, a, k], dim=-1)[labels[b, a, k]]
                    num += float(weights[k] * ce)
                    den += float(weights[k])
                    hits[k] += int(logits[b, a, k].argmax() == labels[b, a, k])
                    counts[k] += 1
    assert float(loss) == pytest.approx(num / den, rel=1e-5)
    assert acc.tolist() == pytest.approx([h / max(c, 1) for h, c in zip(hits, counts, strict=True)])


def _tiny_pair(seed: int = 0, block_size: int = 4) -> tuple[TargetModel, DFlashDrafter]:
    torch.manual_seed(seed)
    target = TargetModel(TargetConfig(
        family="qwen3", vocab_size=50, hidden_size=32, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        bos_token_id=None, eos_token_id=0)).eval()
    with torch.no_grad():
        target.embed_tokens.weight.normal_(0, 1.0)
    config = DrafterTrainConfig(num_layers=2, intermediate_size=64, block_size=block_size)
    drafter = DFlashDrafter(config.drafter_config(target, mask_token_id=1)).eval()
    return target, drafter


def test_drafter_config_follows_the_target_and_the_z_lab_rule() -> None:
    target, drafter = _tiny_pair()
    c = drafter.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 2, 1, 16)
    assert c.target_layer_ids == (1, 3)  # round(1 + i * (6 - 4) / (2 - 1))
    assert c.block_size == 4 and c.mask_token_id == 1 and c.vocab_size == 50
    drafter.check_target(target)


def _leading_matches_via_engine_api(target, drafter, ids: torch.Tensor, anchor: int) -> int:
    """Reference: the engine's cached path (append_context + draft_logits) for one block, counted in a loop;
    depths past the row end count as matches (the replay never stops a run there)."""
    bs = drafter.config.block_size
    cache = drafter.allocate_cache(1, ids.shape[1])
    feats = target_features(target, drafter, ids)
    slots = torch.tensor([0])
    pos = torch.arange(anchor)[None]
    drafter.append_context(feats[:, :anchor], pos, cache, slots, pos)
    logits = drafter.draft_logits(target, ids[:, anchor], torch.tensor([anchor]), cache, slots, bs)
    matched = 0
    for k in range(1, bs):
        if anchor + k < ids.shape[1] and int(logits[0, k - 1].argmax()) != int(ids[0, anchor + k]):
            break
        matched += 1
    return matched


@torch.no_grad()
def test_block_acceptance_replays_the_chain_like_the_engine_path() -> None:
    target, drafter = _tiny_pair(seed=3)
    prompt_len, seq = 6, 30
    ids = torch.randint(2, 50, (2, seq), generator=torch.Generator().manual_seed(4))
    # Plant the drafter's own proposals in places so that rounds accept several tokens.
    for b in range(2):
        for anchor in (prompt_len, 14):
            cache = drafter.allocate_cache(1, seq)
            row = ids[b:b + 1]
            feats = target_features(target, drafter, row)
            pos = torch.arange(anchor)[None]
            drafter.append_context(feats[:, :anchor], pos, cache, torch.tensor([0]), pos)
            draft = drafter.draft_logits(target, row[:, anchor], torch.tensor([anchor]), cache,
                                         torch.tensor([0]), 4).argmax(-1)
            ids[b, anchor + 1:anchor + 3] = draft[0, :2]
    data = Continuations(tokens=ids, prompt_len=prompt_len)
    result = block_acceptance(drafter, target, data, anchors_per_pass=7, device=torch.device("cpu"))

    rounds_total, per_row, full_matches = 0, [], []
    for b in range(2):
        row = ids[b:b + 1]
        anchor, rounds = prompt_len, 0  # prefill commits position prompt_len; rounds start from it
        while anchor < seq - 1:
            m = _leading_matches_via_engine_api(target, drafter, row, anchor)
            anchor += min(m + 1, seq - 1 - anchor)
            rounds += 1
        rounds_total += rounds
        per_row.append((seq - prompt_len) / rounds)
        full_matches += [_leading_matches_via_engine_api(target, drafter, row, a)
                         for a in range(prompt_len - 1, seq - 4 + 1)]
    assert result["accept_length"] == pytest.approx(2 * (seq - prompt_len) / rounds_total, abs=1e-4)
    assert result["accept_length_per_row_mean"] == pytest.approx(sum(per_row) / 2, abs=1e-4)
    assert result["anchors"] == len(full_matches)
    assert result["anchor_mean_accept"] == pytest.approx(1 + sum(full_matches) / len(full_matches), abs=1e-4)
    assert result["accept_length"] > 1.05  # the planted agreements are found


def test_replay_counts_plain_decoding_as_one_token_per_round() -> None:
    assert replay_chain([0] * 40, prompt_len=10, seq_len=50) == 39  # 40 tokens: 1 from prefill + 39 rounds
    assert replay_chain([15] * 40, prompt_len=10, seq_len=50) == 3  # 16 + 16 + 7 tokens after prefill


@torch.no_grad()
def test_init_from_target_gives_the_first_layer_the_targets_own_context_kv() -> None:
    target, drafter = _tiny_pair(seed=5)  # 6 target layers, 2 drafter layers reading target layers (1, 3)
    init_from_target(drafter, target)
    ids = torch.randint(2, 50, (1, 12), generator=torch.Generator().manual_seed(6))
    feats = target_features(target, drafter, ids)
    positions = torch.arange(12)[None]
    cos, sin = drafter.rotary(positions, feats.dtype)
    k_draft, v_draft = drafter.layers[0].self_attn.project_kv(drafter.context(feats), cos, sin)
    # The target's own layer 4 K/V: its input norm over the residual stream after layer 3.
    h3 = target.forward_train(ids, (3,), with_logits=False).hidden
    layer4 = target.layers[4]
    k_ref, v_ref = layer4.self_attn.project_kv(layer4.input_layernorm(h3), cos, sin)
    assert torch.allclose(k_draft, k_ref, atol=1e-5) and torch.allclose(v_draft, v_ref, atol=1e-5)
    assert torch.equal(drafter.layers[1].mlp.up_proj.weight, target.layers[5].mlp.up_proj.weight)
    assert torch.equal(drafter.norm.weight, target.norm.weight)
    with pytest.raises(ConfigError, match="intermediate_size"):
        bad = DFlashDrafter(DrafterTrainConfig(num_layers=2, intermediate_size=32, block_size=4)
                            .drafter_config(target, mask_token_id=1))
        init_from_target(bad, target)
