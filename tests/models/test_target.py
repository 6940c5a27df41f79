"""TargetModel against transformers, and its cache/visibility contract against plain causal runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import hf_target, random_target, rel_err

from ddtree.models import KVCache, TargetModel, load_target, save_target

FAMILIES = [("qwen3", False), ("qwen3", True), ("qwen2", True), ("qwen2", False), ("llama", False),
            ("llama", True)]


def causal_mask(batch: int, start: int, new: int, length: int) -> torch.Tensor:
    """[batch, new, length]: token t (at cache index start + t) sees cache indices 0 .. start + t."""
    s = torch.arange(length)
    return (s[None, :] <= start + torch.arange(new)[:, None]).expand(batch, -1, -1)


def cached_full_forward(model: TargetModel, ids: torch.Tensor, hidden_layers=()):
    """One prefill of the whole sequence through the cached path."""
    batch, seq = ids.shape
    cache = model.allocate_cache(batch, seq + 4)
    pos = torch.arange(seq).expand(batch, -1)
    return model(ids, pos, cache, torch.arange(batch), pos, causal_mask(batch, 0, seq, seq),
                 hidden_layers=hidden_layers)


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_matches_transformers(tmp_path, family, tied):
    hf = hf_target(family, tied)
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path)
    assert ours.config.family == family and ours.config.tie_word_embeddings == tied
    ids = torch.randint(0, ours.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    ref = hf(ids, output_hidden_states=True)
    layers = (0, 1, 2)
    for out in (ours.forward_train(ids, layers), cached_full_forward(ours, ids, layers)):
        assert rel_err(out.logits, ref.logits) < 1e-4
        for j, i in enumerate(layers):
            got = out.hidden[..., j * 32:(j + 1) * 32]
            assert rel_err(got, ref.hidden_states[i + 1]) < 1e-4, f"hidden after layer {i}"


def test_llama3_rope_scaling_is_applied(tmp_path):
    """The llama3 scaling changes the logits (so the equivalence above really exercises it)."""
    hf = hf_target("llama", False)
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    plain = TargetModel(dataclasses.replace(ours.config, rope_scaling=None)).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.arange(40).remainder(97)[None]
    assert rel_err(plain.forward_train(ids).logits, ours.forward_train(ids).logits) > 1e-3


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_save_loads_in_transformers_and_back(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model = random_target(tie_word_embeddings=tied, family="llama", qk_norm=False, attention_bias=True)
    save_target(model, tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    back = load_target(tmp_path)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = model.forward_train(ids).logits
    assert rel_err(hf(ids).logits, ref) < 1e-4
    assert torch.equal(back.forward_train(ids).logits, ref)


def test_load_in_bfloat16(tmp_path):
    model = random_target()
    save_target(model, tmp_path)
    bf = load_target(tmp_path, dtype=torch.bfloat16)
    assert bf.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    out = bf.forward_train(ids).logits
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), model.forward_train(ids).logits) < 5e-2


def test_prefill_then_incremental_equals_one_forward():
    model = random_target()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    full = model.forward_train(ids, hidden_layers=(1, 3))
    cache = model.allocate_cache(2, 16)
    slots = torch.tensor([1, 0])  # deliberately not the row order
    logits, hidden = [], []
    for start, end in ((0, 5), (5, 6), (6, 7), (7, 10), (10, 12)):
        pos = torch.arange(start, end).expand(2, -1)
        out = model(ids[:, start:end], pos, cache, slots, pos, causal_mask(2, start, end - start, 16),
                    hidden_layers=(1, 3))
        logits.append(out.logits)
        hidden.append(out.hidden)
    assert rel_err(torch.cat(logits, 1), full.logits) < 1e-4
    assert rel_err(torch.cat(hidden, 1), full.hidden) < 1e-4


def test_logits_at_selects_rows_and_empty_means_none():
    model = random_target()
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    full = cached_full_forward(model, ids).logits
    cache = model.allocate_cache(2, 8)
    pos = torch.arange(6).expand(2, -1)
    at = torch.tensor([[5, 0], [2, 2]])
    picked = model(ids, pos, cache, torch.arange(2), pos, causal_mask(2, 0, 6, 6), logits_at=at).logits
    assert picked.shape == (2, 2, 97)
    assert torch.allclose(picked, torch.gather(full, 1, at[..., None].expand(-1, -1, 97)), atol=1e-5)
    none = model(ids, pos, model.allocate_cache(2, 8), torch.arange(2), pos, causal_mask(2, 0, 6, 6),
                 logits_at=at[:, :0])
    assert none.logits is None and none.hidden is None


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """parents (root = -1, parent index < child index) and depths of a random tree of n nodes."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=gen))
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents, depths


def test_tree_forward_equals_each_path_run_causally():
    """Verify two random trees (different prefix lengths) plus a padding row in one batched forward."""
    model = random_target()
    gen = torch.Generator().manual_seed(7)
    prefix_lens, n_nodes, max_len = [5, 3], 9, 24
    cache = model.allocate_cache(2, max_len)
    prefixes = [torch.randint(0, 97, (p,), generator=gen) for p in prefix_lens]
    for r, prefix in enumerate(prefixes):  # prefill each request into its own slot
        pos = torch.arange(len(prefix))[None]
        model(prefix[None], pos, cache, torch.tensor([r]), pos, causal_mask(1, 0, len(prefix), len(prefix)))
    trees = [random_tree(n_nodes, gen) for _ in prefixes]
    tokens = torch.randint(0, 97, (3, n_nodes), generator=gen)
    positions = torch.zeros(3, n_nodes, dtype=torch.long)
    write_pos = torch.zeros(3, n_nodes, dtype=torch.long)
    length = max(prefix_lens) + n_nodes
    mask = torch.zeros(3, n_nodes, length, dtype=torch.bool)
    for r, ((parents, depths), p) in enumerate(zip(trees, prefix_lens, strict=True)):
        positions[r] = p + torch.tensor(depths)
        write_pos[r] = p + torch.arange(n_nodes)
        for i in range(n_nodes):
            mask[r, i, :p] = True
            j = i
            while j >= 0:
                mask[r, i, p + j] = True
                j = parents[j]
    mask[2, :, 0] = True  # padding row: scratch slot, sees something so SDPA stays finite
    slots = torch.tensor([0, 1, cache.scratch_slot])
    out = model(tokens, positions, cache, slots, write_pos, mask, hidden_layers=(2,))
    for r, ((parents, _), prefix) in enumerate(zip(trees, prefixes, strict=True)):
        for i in range(n_nodes):
            path, j = [], i
            while j >= 0:
                path.append(int(tokens[r, j]))
                j = parents[j]
            seq = torch.cat([prefix, torch.tensor(path[::-1])])[None]
            ref = model.forward_train(seq, hidden_layers=(2,))
            assert rel_err(out.logits[r, i], ref.logits[0, -1]) < 1e-4, (r, i)
            assert rel_err(out.hidden[r, i], ref.hidden[0, -1]) < 1e-4, (r, i)
    assert torch.isfinite(out.logits[2]).all()


def test_scratch_slot_writes_leave_live_slots_alone():
    model = random_target()
    cache = model.allocate_cache(2, 8)
    before = cache.k.clone()
    ids = torch.zeros(2, 3, dtype=torch.long)
    pos = torch.arange(3).expand(2, -1)
    scratch = torch.full((2,), cache.scratch_slot)
    model(ids, pos, cache, scratch, pos, causal_mask(2, 0, 3, 3))
    assert torch.equal(cache.k[:, :2], before[:, :2])
    assert cache.k[:, 2].abs().sum() > 0


def test_kv_cache_allocate_shapes():
    cache = KVCache.allocate(3, 4, 2, 16, 8, dtype=torch.float16)
    assert cache.k.shape == (3, 5, 2, 16, 8)
    assert cache.scratch_slot == 4 and cache.slots == 4 and cache.max_len == 16
    assert cache.nbytes == 2 * 3 * 5 * 2 * 16 * 8 * 2


def test_folded_gqa_attention_equals_grouped_sdpa():
    """The CUDA path's GQA folding (exercised here on CPU) equals SDPA's own grouped-query attention."""
    import torch.nn.functional as F

    from ddtree.models.layers import folded_gqa_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 5, 16, generator=gen)
    k = torch.randn(3, 2, 11, 16, generator=gen)
    v = torch.randn(3, 2, 11, 16, generator=gen)
    mask = torch.rand(3, 1, 5, 11, generator=gen) > 0.4
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for matmul in (False, True):
        got = folded_gqa_attention(q, k, v, mask, matmul=matmul)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
