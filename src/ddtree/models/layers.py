"""Building blocks shared by the target and the drafter: RMSNorm, SwiGLU MLP, RoPE, attention, decoder layer.

The maths follows transformers' Qwen3/Qwen2/Llama code operation for operation (RMSNorm in fp32, RoPE angles in
fp32, ``rotate_half`` layout, ``1/sqrt(head_dim)`` scaling) so that our logits match theirs to rounding.

Attention is the one place that knows about visibility. A decoder layer computes Q, K, V for its new tokens and
hands them to an ``attend`` callable supplied by the model: the target's writes K/V into its cache and attends
over cache positions, the drafter's prepends the context K/V. Each ``attend`` ends in :func:`masked_attention`,
the single SDPA call with a boolean mask, so swapping in flex_attention or a Triton kernel later is a local change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# attend(layer_index, q [R, H, T, D], k [R, KV, T, D], v [R, KV, T, D]) -> [R, H, T, D]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # [..., dim]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32, CPU) for plain, ``linear`` or ``llama3`` RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")  # configs are validated before we get here


class Rotary(nn.Module):
    """RoPE angles for explicit positions. ``inv_freq`` is a non-persistent buffer; after building a model on the
    meta device call :meth:`reset` to materialise it."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset(self, device: torch.device | str) -> None:
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [R, T] -> (cos, sin), each [R, T, head_dim] in ``dtype`` (angles computed in fp32)."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, T, heads, D], cos/sin [R, T, D] -> x rotated (the ``rotate_half`` convention)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool = False) -> Tensor:
    """The one attention kernel call. q [R, H, T, D], k/v [R, KV, S, D], mask [R, 1 | H, T, S] bool
    (True = attend) or None -> [R, H, T, D]. Every mask row must allow at least one key.

    On CUDA, a masked grouped-query call goes through :func:`folded_gqa_attention`: SDPA's fused kernels take an
    arbitrary mask but not ``enable_gqa``, and the math fallback materialises [R, H, T, S] scores."""
    grouped = q.shape[1] != k.shape[1]
    if grouped and mask is not None and q.is_cuda and mask.shape[1] == 1:
        return folded_gqa_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=grouped)


# Attention runs as two cuBLAS matmuls instead of SDPA's fused kernel while the folded query rows per KV head stay
# at most MATMUL_ATTENTION_MAX_ROWS and the fp32 scores under MATMUL_ATTENTION_MAX_SCORES elements: with few query
# rows the fused kernels launch one thread block per (row, KV head) and walk every key serially, while a matmul
# parallelises over the keys (measured on the H200: AR at 8k context 47.7 -> 63.9 tok/s); with many query rows
# (large trees) the fused kernel wins again (docs/benchmarks/gpu.md).
MATMUL_ATTENTION_MAX_ROWS = 64
MATMUL_ATTENTION_MAX_SCORES = 1 << 25


def folded_gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, matmul: bool | None = None) -> Tensor:
    """Grouped-query attention as plain attention: the G query heads that share a KV head are folded into the
    query axis (q [R, H, T, D] -> [R, KV, G * T, D], mask rows repeated G times), which is exact (each query row's
    softmax is over the same keys) and needs no copy of K/V per head.
    mask [R, 1, T, S] bool -> [R, H, T, D]. ``matmul`` forces (True) or forbids (False) the matmul path; by
    default it is used while the scores stay under ``MATMUL_ATTENTION_MAX_SCORES`` elements."""
    r, h, t, d = q.shape
    kv = k.shape[1]
    g = h // kv
    s = k.shape[2]
    qf = q.reshape(r, kv, g * t, d)  # head j*G + i -> group j, rows i*T .. i*T + T - 1
    mf = mask[:, :, None].expand(r, 1, g, t, s).reshape(r, 1, g * t, s)
    if matmul is None:
        matmul = g * t <= MATMUL_ATTENTION_MAX_ROWS and r * kv * g * t * s <= MATMUL_ATTENTION_MAX_SCORES
    if matmul:
        scores = torch.matmul(qf, k.transpose(-1, -2)).float() * d**-0.5  # [R, KV, G*T, S]
        probs = torch.softmax(scores.masked_fill(~mf, -torch.inf), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)
    else:
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf)
    return out.reshape(r, h, t, d)


class SelfAttention(nn.Module):
    """Q/K/V/O projections, optional per-head q_norm/k_norm (Qwen3) and RoPE; visibility is the caller's."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [R, T, hidden] -> q [R, H, T, D] (normed, rotated)."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin).transpose(1, 2)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [R, T, hidden] -> k, v [R, KV, T, D] (k normed and rotated)."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``; parameter names match transformers."""

    def __init__(self, index: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.index = index
        self.self_attn = SelfAttention(hidden, num_heads, num_kv_heads, head_dim, eps,
                                       qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        """h [R, T, hidden], cos/sin [R, T, D] -> [R, T, hidden]."""
        x = self.input_layernorm(h)
        q = self.self_attn.project_q(x, cos, sin)
        k, v = self.self_attn.project_kv(x, cos, sin)
        out = attend(self.index, q, k, v)  # [R, H, T, D]
        h = h + self.self_attn.o_proj(out.transpose(1, 2).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))
