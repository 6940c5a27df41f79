"""DFlashDrafter against a plain full-recompute reference written here (no cache, explicit loops for the mask)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_drafter, random_target, rel_err
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from ddtree.engine.kernels import KernelSet
from ddtree.errors import ConfigError
from ddtree.models import DFlashDrafter, KVCache, TargetModel


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def reference_draft(drafter: DFlashDrafter, target: TargetModel, features: torch.Tensor, ctx_pos: list[int],
                    root: int, start: int, block_size: int) -> torch.Tensor:
    """Logits [block_size - 1, V] for one request whose visible context is ``features`` [N, F] at absolute
    positions ``ctx_pos``; the block's anchor ``root`` sits at ``start``. Recomputes everything."""
    c = drafter.config
    heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
    rope = Qwen3RotaryEmbedding(Qwen3Config(head_dim=d, hidden_size=c.hidden_size, num_attention_heads=heads,
                                            rope_theta=c.rope_theta, max_position_embeddings=512))
    ctx = rms(features @ drafter.fc.weight.T, drafter.hidden_norm.weight, c.rms_norm_eps)
    ids = [root] + [c.mask_token_id] * (block_size - 1)
    h = target.embed_tokens.weight[ids] * c.input_embedding_scale
    q_pos = torch.arange(start, start + block_size)
    k_pos = torch.cat([torch.tensor(ctx_pos, dtype=torch.long), q_pos])
    n_ctx = len(ctx_pos)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        causal, window = c.layer_is_causal(i), c.layer_window(i)
        allowed = torch.zeros(block_size, n_ctx + block_size, dtype=torch.bool)
        for qi in range(block_size):
            for kj in range(n_ctx + block_size):
                qp, kp = int(q_pos[qi]), int(k_pos[kj])
                ok = True
                if kj >= n_ctx and causal and kp > qp:
                    ok = False
                if window is not None and abs(qp - kp) >= window:
                    ok = False
                allowed[qi, kj] = ok
        x = rms(h, layer.input_layernorm.weight, c.rms_norm_eps)
        both = torch.cat([ctx, x])
        q = rms((x @ a.q_proj.weight.T).view(block_size, heads, d), a.q_norm.weight, c.rms_norm_eps)
        k = rms((both @ a.k_proj.weight.T).view(-1, kv, d), a.k_norm.weight, c.rms_norm_eps)
        v = (both @ a.v_proj.weight.T).view(-1, kv, d)
        cos_q, sin_q = rope(q, q_pos[None])
        cos_k, sin_k = rope(k, k_pos[None])
        q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos_q, sin_q)
        _, k = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_k, sin_k)
        k = k[0].repeat_interleave(heads // kv, 0)
        v = v.transpose(0, 1).repeat_interleave(heads // kv, 0)
        scores = q[0] @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(block_size, heads * d)
        h = h + out @ a.o_proj.weight.T
        x = rms(h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        m = layer.mlp
        h = h + (F.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    h = rms(h, drafter.norm.weight, c.rms_norm_eps)
    logits = h[1:] @ target.lm_head.weight.T * c.output_multiplier
    if c.final_logit_softcapping is not None:
        logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
    return logits


def features_of(target: TargetModel, drafter: DFlashDrafter, ids: torch.Tensor) -> torch.Tensor:
    return target.forward_train(ids, drafter.config.target_layer_ids).hidden


def fill_context(drafter: DFlashDrafter, features: torch.Tensor, lens: list[int], cache: KVCache,
                 slots: list[int], kernels: KernelSet | None = None) -> None:
    """Append each request's context in two uneven chunks (exercises incremental appends)."""
    for r, (n, slot) in enumerate(zip(lens, slots, strict=True)):
        cut = n // 3
        for lo, hi in ((0, cut), (cut, n)):
            if hi > lo:
                pos = torch.arange(lo, hi)[None]
                drafter.append_context(features[r:r + 1, lo:hi], pos, cache, torch.tensor([slot]), pos,
                                       kernels=kernels)


CASES = {
    "full": {},
    "sliding": dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3),
    "all_sliding_noncausal": dict(layer_types=("sliding_attention",) * 2, sliding_window=5, is_causal=False),
    "scaled": dict(input_embedding_scale=1.7, output_multiplier=0.5, final_logit_softcapping=2.0),
}


@pytest.mark.parametrize("case", CASES)
def test_draft_logits_match_full_recompute(case):
    target = random_target()
    drafter = random_drafter(**CASES[case])
    drafter.check_target(target)
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(4))
    features = features_of(target, drafter, ids)
    lens, bs = [8, 5], drafter.config.block_size
    cache = drafter.allocate_cache(2, 20)
    fill_context(drafter, features, lens, cache, slots=[1, 0])
    roots = torch.tensor([int(ids[0, 8]), int(ids[1, 5]), 0])
    slots = torch.tensor([1, 0, cache.scratch_slot])  # third row: padding
    out = drafter.draft_logits(target, roots, torch.tensor(lens + [0]), cache, slots, bs, kv_len=12)
    assert out.shape == (3, bs - 1, 97)
    for r, n in enumerate(lens):
        ref = reference_draft(drafter, target, features[r, :n], list(range(n)), int(roots[r]), n, bs)
        assert rel_err(out[r], ref) < 1e-4, r
    assert torch.isfinite(out[2]).all()


@pytest.mark.parametrize("case", ["full", "sliding"])
def test_window_equals_recompute_over_truncated_context(case):
    target = random_target()
    drafter = random_drafter(**CASES[case])
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(5))
    features = features_of(target, drafter, ids)
    lens, windows, bs = [10, 7], [4, 6], 4
    cache = drafter.allocate_cache(2, 16)
    fill_context(drafter, features, lens, cache, slots=[0, 1])
    roots = ids[torch.arange(2), torch.tensor(lens)]
    out = drafter.draft_logits(target, roots, torch.tensor(lens), cache, torch.arange(2), bs,
                               window=torch.tensor(windows))
    for r, (n, w) in enumerate(zip(lens, windows, strict=True)):
        ref = reference_draft(drafter, target, features[r, n - w:n], list(range(n - w, n)), int(roots[r]), n, bs)
        assert rel_err(out[r], ref) < 1e-4, r
    unwindowed = drafter.draft_logits(target, roots, torch.tensor(lens), cache, torch.arange(2), bs)
    assert rel_err(unwindowed, out) > 1e-3  # the window really hid something


def test_block_len_drafts_as_if_alone():
    target = random_target()
    drafter = random_drafter(block_size=6)
    ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(6))
    features = features_of(target, drafter, ids)
    cache = drafter.allocate_cache(2, 16)
    fill_context(drafter, features, [7, 7], cache, slots=[0, 1])
    roots, ctx = ids[:, 7], torch.tensor([7, 7])
    mixed = drafter.draft_logits(target, roots, ctx, cache, torch.arange(2), 6, block_len=torch.tensor([3, 6]))
    short = drafter.draft_logits(target, roots[:1], ctx[:1], cache, torch.tensor([0]), 3)
    full = drafter.draft_logits(target, roots[1:], ctx[1:], cache, torch.tensor([1]), 6)
    assert rel_err(mixed[0, :2], short[0]) < 1e-5
    assert rel_err(mixed[1], full[0]) < 1e-5
    assert rel_err(short[0], full[0, :2]) > 1e-3  # block size matters for a non-causal drafter


@pytest.mark.parametrize("case,window", [("full", None), ("sliding", None), ("full", 5), ("scaled", None)])
def test_forward_train_equals_draft_logits_block_by_block(case, window):
    target = random_target()
    drafter = random_drafter(**CASES[case])
    ids = torch.randint(0, 90, (2, 14), generator=torch.Generator().manual_seed(8))
    features = features_of(target, drafter, ids)
    anchors = torch.tensor([[2, 6, 9], [0, 7, 13]])
    bs = 4
    logits = drafter.forward_train(target, ids, features, anchors, block_size=bs, window=window)
    assert logits.shape == (2, 3, bs - 1, 97)
    hidden = drafter.forward_train(target, ids, features, anchors, block_size=bs, window=window, return_hidden=True)
    assert torch.equal(drafter.head(target, hidden), logits)
    for b in range(2):
        for a in range(3):
            p = int(anchors[b, a])
            cache = drafter.allocate_cache(1, 16)
            if p:
                pos = torch.arange(p)[None]
                drafter.append_context(features[b:b + 1, :p], pos, cache, torch.tensor([0]), pos)
            win = None if window is None else torch.tensor([window])
            ref = drafter.draft_logits(target, ids[b, p:p + 1], torch.tensor([p]), cache, torch.tensor([0]), bs,
                                       window=win)
            assert rel_err(logits[b, a], ref[0]) < 1e-4, (b, a)


def test_forward_train_has_gradients():
    target = random_target()
    drafter = random_drafter()
    ids = torch.randint(0, 90, (1, 10), generator=torch.Generator().manual_seed(9))
    features = features_of(target, drafter, ids)
    with torch.enable_grad():
        logits = drafter.forward_train(target, ids, features, torch.tensor([[1, 4]]))
        logits.logsumexp(-1).sum().backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0


def test_check_target_rejects_mismatched_target():
    drafter = random_drafter(target_layer_ids=(0, 5))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        drafter.check_target(random_target())


def test_tree_kernel_path_equals_the_dense_path(triton_kernels_on_cpu):
    """draft_logits with KernelSet.draft_attention (block K/V written into the cache, the Triton kernel reading context and block
    by slot, the window as the kernel's first visible key) gives the dense path's logits: mixed context lengths, a
    window, a shorter block_len and a padding row on the scratch slot. It leaves the committed context untouched."""
    from ddtree import triton_runtime

    if triton_runtime.triton is None or not triton_runtime.INTERPRETED:
        pytest.skip("needs Triton's interpreter (CPU tensors); on a GPU test_engine_kernels covers this path")
    target = random_target()
    drafter = random_drafter(head_dim=64, block_size=5)
    assert drafter.supports_tree_attention()
    assert not random_drafter(head_dim=64, **CASES["sliding"]).supports_tree_attention()
    ids = torch.randint(0, 90, (3, 14), generator=torch.Generator().manual_seed(8))
    features = features_of(target, drafter, ids)
    lens = [12, 5, 9]
    cache = drafter.allocate_cache(3, 24)
    fill_context(drafter, features, lens, cache, slots=[2, 0, 1])
    roots = torch.tensor([int(ids[0, 12]), int(ids[1, 5]), int(ids[2, 9]), 0])
    ctx = torch.tensor(lens + [0])
    slots = torch.tensor([2, 0, 1, cache.scratch_slot])
    window = torch.tensor([4, 1 << 30, 20, 1 << 30])
    block_len = torch.tensor([5, 3, 5, 5])
    before = cache.k.clone()
    dense = drafter.draft_logits(target, roots, ctx, cache, slots, 5, block_len=block_len, window=window, kv_len=13)
    fast = drafter.draft_logits(target, roots, ctx, cache, slots, 5, block_len=block_len, window=window, kv_len=13,
                                kernels=replace(KernelSet.torch(), draft_attention=True))
    assert rel_err(fast[:3], dense[:3]) < 1e-4
    assert rel_err(fast[1, :2], dense[1, :2]) < 1e-4  # the short block's live depths
    for r, n in enumerate(lens):
        assert torch.equal(cache.k[:, slots[r], :, :n], before[:, slots[r], :, :n])


def test_kernel_norms_and_context_writes_equal_the_eager_drafter(triton_kernels_on_cpu, monkeypatch):
    """Fused with kernels (the engine on a GPU), the drafter's context norm and final norm run the Triton norm and
    append_context writes each layer's K/V with write_kv; the cache it fills and the logits it drafts equal those
    of the same drafter without kernels (the spies prove the kernel path ran)."""
    import copy

    from ddtree import triton_runtime
    from ddtree.models import fuse_projections, fused_ops, tree_attention

    if triton_runtime.triton is None or not triton_runtime.INTERPRETED:
        pytest.skip("needs Triton's interpreter (CPU tensors); on a GPU test_engine_kernels covers this path")
    target = random_target()
    eager = random_drafter(head_dim=64, block_size=5)
    fast = copy.deepcopy(eager)
    fuse_projections(eager)
    fuse_projections(fast)
    chosen = {"eager": KernelSet.torch(), "fast": replace(KernelSet.torch(), fused_ops=True)}
    calls = {"norm": 0, "write": 0}
    for module, name, key in ((fused_ops, "rms_norm", "norm"), (tree_attention, "write_kv", "write")):
        original = getattr(module, name)

        def spy(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    features = features_of(target, eager, ids)
    lens, slots = [10, 7], [1, 0]
    caches = {}
    logits = {}
    with torch.inference_mode():
        for name, drafter in (("eager", eager), ("fast", fast)):
            caches[name] = drafter.allocate_cache(2, 20)
            fill_context(drafter, features, lens, caches[name], slots, chosen[name])
            logits[name] = drafter.draft_logits(target, ids[:, 0], torch.tensor(lens), caches[name],
                                                torch.tensor(slots), 5, kv_len=12, kernels=chosen[name])
            if name == "eager":
                assert calls == {"norm": 0, "write": 0}
    assert calls["write"] == 4 * len(fast.layers)  # two chunks per request, every layer
    # the context norm per append, each layer's input norm and the final norm per draft
    assert calls["norm"] == 4 + len(fast.layers) + 1
    for r, (n, slot) in enumerate(zip(lens, slots, strict=True)):
        for cache in ("k", "v"):
            got = getattr(caches["fast"], cache)[:, slot, :, :n]
            want = getattr(caches["eager"], cache)[:, slot, :, :n]
            assert rel_err(got, want) < 1e-5, (r, cache)
    assert rel_err(logits["fast"], logits["eager"]) < 1e-4


def test_context_appends_keep_autograd_when_the_kv_projections_train(triton_kernels_on_cpu):
    """Fused with kernels, but the K projections need grad (ctx and the norms do not): append_context must write
    through KVCache.write, which autograd sees, not through write_kv, which it does not."""
    from ddtree import triton_runtime
    from ddtree.models import fuse_projections

    if triton_runtime.triton is None or not triton_runtime.INTERPRETED:
        pytest.skip("needs Triton's interpreter (CPU tensors)")
    target = random_target()
    drafter = random_drafter(head_dim=64, block_size=5)
    fuse_projections(drafter)
    drafter.requires_grad_(False)
    for layer in drafter.layers:
        layer.self_attn.k_proj.weight.requires_grad_(True)
    ids = torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        features = features_of(target, drafter, ids)
    cache = drafter.allocate_cache(1, 10)
    pos = torch.arange(6)[None]
    with torch.enable_grad():
        drafter.append_context(features, pos, cache, torch.tensor([0]), pos,
                               kernels=replace(KernelSet.torch(), fused_ops=True))
        assert cache.k.requires_grad
        cache.k.sum().backward()
    assert all(layer.self_attn.k_proj.weight.grad is not None for layer in drafter.layers)
