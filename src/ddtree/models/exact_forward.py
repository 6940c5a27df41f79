"""The target's forward in exact mode: every op computes a token row the same way whatever else is in the call.

Why a forward of its own: exact mode swaps every reduction of the target's layers (the five linears, attention, the
norms) for one whose order per output element is fixed (:mod:`ddtree.models.batch_invariant`), and keeping that in
one place lets the ordinary layers stay as they are. The maths is the decoder layer's (:mod:`ddtree.models.layers`),
step for step::

    x = rms_norm(h)                      per row (fused_ops Triton kernel: one program per row)
    q, k, v = qk_norm_rope(linear(x))    fixed-order matmul; per-(row, head) norm + RoPE kernel
    write k, v at start + t; attention   keys in position order, fixed tiles and splits
    h, x = add_rms_norm(h, linear(o))    per row
    h = h + linear(silu_mul(linear(x)))  element-wise SiLU x up; fixed-order matmuls
    logits = linear(rms_norm(h))         the LM head, fixed order too

The embedding is a gather, RoPE's angles are element-wise: both are per row already. With ``triton=False`` (a
device Triton cannot run on: the CPU) every op runs one token row at a time through the eager code instead, so each
call has the shapes of a single row (invariant by construction, slow). Not covered: fp8 projections (the target has
none; the drafter, which may, needs no exactness: it only proposes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.errors import ConfigError
from ddtree.models import batch_invariant as bi
from ddtree.models import exact_blas, fused_ops, tree_attention
from ddtree.models.batch_invariant import attention_rules
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import DecoderLayer, RMSNorm, apply_rope
from ddtree.speculative.attention import TreeVisibility


def _weight(linears: tuple[torch.nn.Linear, ...], fused) -> tuple[Tensor, Tensor | None]:
    """The fused weight and bias of ``linears`` (the engine fuses them once; otherwise concatenated here)."""
    if fused is not None and fused.intact():
        return fused.weight, fused.bias
    weight = torch.cat([lin.weight for lin in linears], 0)
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears], 0)
    return weight, bias


def layer_weights(layer: DecoderLayer) -> dict[str, tuple[Tensor, Tensor | None]]:
    """The four projections of a decoder layer as this forward multiplies them: name -> (weight [N, K], bias)."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": _weight((attn.q_proj, attn.k_proj, attn.v_proj), attn.qkv),
            "o_proj": (attn.o_proj.weight, attn.o_proj.bias),
            "gate_up": (_weight((mlp.gate_proj, mlp.up_proj), mlp.gate_up)[0], None),
            "down": (mlp.down_proj.weight, None)}


class _Ops:
    """The per-op choice of one exact forward: Triton kernels (``triton``) or the torch path one row at a time;
    ``blas``: (N, K, pad) of the weight shapes whose torch matmul the engine measured row-invariant at every row
    count it runs, calls of fewer than ``pad`` rows padded to it (:mod:`ddtree.models.exact_blas`), which go to
    cuBLAS instead of the Triton matmul."""

    def __init__(self, triton: bool, blas: tuple[tuple[int, int, int], ...] = ()) -> None:
        self.triton = triton
        self.blas = {(n, k): pad for n, k, pad in blas}

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not self.triton:
            return bi.linear_rows(x, weight, bias)
        pad = self.blas.get((weight.shape[0], weight.shape[1]))
        if pad is not None:  # one 2-D call of at least pad rows: the layout the start-up check measured
            return exact_blas.linear_padded(x, weight, bias, pad)
        return bi.linear(x, weight, bias)

    def norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        if self.triton:
            return fused_ops.rms_norm(x, norm.weight, norm.eps)
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([norm(rows[i:i + 1]) for i in range(rows.shape[0])], 0).reshape(x.shape)

    def add_norm(self, h: Tensor, o: Tensor, norm: RMSNorm) -> tuple[Tensor, Tensor]:
        if self.triton:
            return fused_ops.add_rms_norm(h, o, norm.weight, norm.eps)
        h = h + o  # element-wise
        return h, self.norm(h, norm)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        if self.triton:
            return fused_ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up  # element-wise

    def qk_norm_rope(self, qkv: Tensor, attn, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """qkv [R, T, (H + 2 KV) D] -> q [R, H, T, D], k, v [R, KV, T, D]."""
        h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        if self.triton:
            q_w = None if attn.q_norm is None else attn.q_norm.weight
            k_w = None if attn.k_norm is None else attn.k_norm.weight
            eps = 0.0 if attn.k_norm is None else attn.k_norm.eps
            return fused_ops.qk_norm_rope(qkv, q_w, k_w, cos, sin, h, kv, d, eps)
        q, k, v = qkv.unflatten(-1, (h + 2 * kv, d)).split([h, kv, kv], dim=-2)  # [R, T, heads, D]
        if attn.q_norm is not None:
            q = self._per_row(q, attn.q_norm)
            k = self._per_row(k, attn.k_norm)
        return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def _per_row(self, x: Tensor, norm: RMSNorm) -> Tensor:
        """A per-head norm of x [R, T, heads, D] one token at a time."""
        r, t = x.shape[:2]
        flat = x.reshape(r * t, *x.shape[2:])
        return torch.stack([norm(flat[i]) for i in range(r * t)], 0).reshape(x.shape)

    def attention(self, q, k_cache, v_cache, slots, start, positions, anc, chain, tail, kv_len) -> Tensor:
        if self.triton:
            return bi.attention(q, k_cache, v_cache, slots, start, positions, anc, chain, kv_len, tail=tail)
        return bi.attention_rows(q, k_cache, v_cache, slots, start, positions, anc)

    def write_kv(self, cache: KVCache, layer: int, slots: Tensor, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
        if self.triton and tree_attention.supports_head_dim(k.shape[-1]):
            tree_attention.write_kv(cache.k[layer], cache.v[layer], slots, write_pos, k, v)
        else:
            cache.write(layer, slots, write_pos, k, v)  # a copy: invariant either way


def supports(target, triton: bool) -> bool:
    """Whether the Triton path takes this target (head dim, query heads per KV head); the torch path takes any."""
    c = target.config
    return not triton or (bi.supports_head_dim(c.head_dim)
                          and c.num_heads // c.num_kv_heads <= attention_rules.ATTN_BLOCK_M)


def _layer(layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, ops: _Ops, attend) -> Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    x = ops.norm(h, layer.input_layernorm)
    w, b = _weight((attn.q_proj, attn.k_proj, attn.v_proj), attn.qkv)
    q, k, v = ops.qk_norm_rope(ops.linear(x, w, b), attn, cos, sin)
    out = attend(layer.index, q, k, v)  # [R, H, T, D]
    o = ops.linear(out.transpose(1, 2).flatten(-2), attn.o_proj.weight, attn.o_proj.bias)
    h, x = ops.add_norm(h, o, layer.post_attention_layernorm)
    w, _ = _weight((mlp.gate_proj, mlp.up_proj), mlp.gate_up)
    return h + ops.linear(ops.silu_mul(ops.linear(x, w)), mlp.down_proj.weight)


@torch.inference_mode()
def forward(target, input_ids: Tensor, positions: Tensor, cache: KVCache, slots: Tensor, write_pos: Tensor,
            visibility: TreeVisibility, logits_at: Tensor | None, hidden_layers: tuple[int, ...], *,
            triton: bool, blas: tuple[tuple[int, int, int], ...] = (), head: bool = True):
    """:meth:`ddtree.models.target.TargetModel.forward`'s contract in exact mode -> its ``TargetOutput`` (logits
    [R, N, V] or None, hidden [R, T, len(hidden_layers) * hidden] or None; with ``head`` False the normed states
    instead of the logits, :func:`head_logits` gives them). ``visibility`` must be a :class:`TreeVisibility` (the new
    tokens at ``start + t``; a node sees the prefix and its ancestors, one per depth); ``triton``: the Triton kernels
    (CUDA, or the interpreter in tests) or the torch path one row at a time; ``blas``: weight shapes that passed the
    engine's start-up check (``KernelSet.exact_blas``), multiplied by cuBLAS."""
    attend = attender(target, cache, slots, write_pos, positions, visibility, triton=triton)
    return run(target, input_ids, positions, attend, logits_at, hidden_layers, triton=triton, blas=blas, head=head)


def attender(target, cache: KVCache, slots: Tensor, write_pos: Tensor, positions: Tensor,
             visibility: TreeVisibility, *, triton: bool):
    """Exact mode's attention for rows of ``slots`` under ``visibility`` (a TreeVisibility): ``attend(layer, q, k,
    v)`` writes the new K/V at ``write_pos`` and attends with keys in position order, fixed tiles and splits. The
    ancestor map and, with Triton, the tail table are built once here for every layer."""
    if not isinstance(visibility, TreeVisibility):
        raise ConfigError("exact mode attends from a TreeVisibility (start, new_vis, kv_len), not a dense mask; "
                          "pass the tree visibility (the engine does when KernelSet.exact is on)")
    if not supports(target, triton):
        raise ConfigError(f"exact mode's Triton attention takes head_dim in {bi.SUPPORTED_HEAD_DIMS} and at most "
                          f"{attention_rules.ATTN_BLOCK_M} query heads per KV head; this target has head_dim "
                          f"{target.config.head_dim}, {target.config.num_heads // target.config.num_kv_heads}")
    if not triton and slots.is_cuda:
        raise ConfigError("exact mode on CUDA needs Triton (its one-row-at-a-time torch path reads indices on the "
                          "host, which CUDA graphs cannot capture); install Triton or turn exact mode off")
    ops = _Ops(triton)
    start, kv_len = visibility.start, visibility.kv_len
    anc, chain = bi.ancestor_map(start, positions, visibility.new_vis)
    # which queries share a gathered tile above start: once here for every layer's attention (Triton only)
    c = target.config
    tail = None
    if triton:
        tail = bi.forward_tail(anc, positions, start, c.num_heads // c.num_kv_heads, c.num_kv_heads,
                               visibility.branches)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops.write_kv(cache, layer, slots, write_pos, k, v)
        return ops.attention(q, cache.k[layer], cache.v[layer], slots, start, positions, anc, chain, tail, kv_len)

    return attend


def run(target, input_ids: Tensor, positions: Tensor, attend, logits_at: Tensor | None,
        hidden_layers: tuple[int, ...], *, triton: bool, blas: tuple[tuple[int, int, int], ...] = (), head: bool = True):
    """The target's layers in exact mode with ``attend`` as their attention (:func:`attender`, or a segmented
    forward's, :meth:`ddtree.models.target.TargetModel.forward_segments`) -> its ``TargetOutput``."""
    ops = _Ops(triton, blas)
    weight = _head_weight(target)
    with exact_blas.pinned_blas(input_ids.device) if blas else contextlib.nullcontext():  # the library it checked
        return target.run_layers(input_ids, positions,
                                 lambda layer, h, cos, sin: _layer(layer, h, cos, sin, ops, attend),
                                 lambda h: ops.norm(h, target.norm), (lambda h: ops.linear(h, weight)) if head else None,
                                 logits_at, hidden_layers)


def _head_weight(target) -> Tensor:
    return target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight


@torch.inference_mode()
def head_logits(target, normed: Tensor, *, triton: bool, blas: tuple[tuple[int, int, int], ...] = ()) -> Tensor:
    """Exact mode's head over a ``head=False`` forward's ``normed [R, N, H]`` -> logits ``[R, N, V]``, the same
    bits as the forward's own head (the same op and library choice)."""
    ops = _Ops(triton, blas)
    with exact_blas.pinned_blas(normed.device) if blas else contextlib.nullcontext():
        return ops.linear(normed, _head_weight(target))
