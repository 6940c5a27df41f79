"""Building blocks shared by the target and the drafter: RMSNorm, SwiGLU MLP, RoPE, attention, decoder layer.

The maths follows transformers' Qwen3/Qwen2/Llama code operation for operation (RMSNorm in fp32, RoPE angles in
fp32, ``rotate_half`` layout, ``1/sqrt(head_dim)`` scaling) so that our logits match theirs to rounding.

Attention is the one place that knows about visibility. A decoder layer computes Q, K, V for its new tokens and
hands them to an ``attend`` callable supplied by the model: the target's writes K/V into its cache and attends
over cache positions, the drafter's prepends the context K/V. Each ``attend`` ends in :func:`masked_attention`,
the single SDPA call with a boolean mask, so swapping in flex_attention or a Triton kernel later is a local change.

Fused inference path (:func:`fuse_projections`): q/k/v share one weight matrix and gate/up another, so a layer runs
two matmuls where it ran five; the per-projection parameters become views of the fused matrices, so names, loading
and memory stay as they were. A fused layer's forward given ``kernels=True`` (the caller's choice for that call:
the engine passes ``KernelSet.fused_ops``, :mod:`ddtree.engine.kernels`) also replaces its RMSNorms, q/k-norm + RoPE,
residual add and SwiGLU activation with the Triton kernels of :mod:`ddtree.models.fused_ops` wherever they can run
(:func:`ddtree.triton_runtime.can_run`: CUDA): ~10 kernels per layer instead of ~75. Without fusion, or while
autograd needs the separate parameters, the eager code runs unchanged.

Why the choice is an argument and not module state: a module that remembers it makes two engines over one model
(or a test and an engine) silently share it, and a reader cannot see at the call which code runs. Fusing only
changes the weights' layout; every forward says which kernels it wants.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree.errors import ShapeError
from ddtree.models import fused_ops
from ddtree.triton_runtime import can_run

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


def grad_needed(x: Tensor, *params: Tensor | None) -> bool:
    """Whether autograd must see this call: the Triton kernels and the fused weight have no backward into the
    separate parameters, so training (grad mode on, something requiring grad) keeps the eager path."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p is not None and p.requires_grad for p in params)


class FusedLinear:
    """Linears over the same input (q/k/v, or gate/up) backed by one weight matrix [sum(out), in].

    Each linear's ``weight`` (and ``bias``) is re-pointed to a row block of the fused tensor, so ``state_dict()``
    names, in-place loading and optimiser steps act on the fused storage and memory is not doubled. Anything that
    replaces a parameter instead of writing into it (``.to()``, ``load_state_dict(assign=True)``, deepcopy) breaks
    the sharing; :meth:`intact` notices (the data pointers moved) and the layer runs its separate projections until
    fused again. Deliberately not an ``nn.Module``: the fused tensor must not appear in ``state_dict()``."""

    def __init__(self, linears: tuple[nn.Linear, ...], weight: Tensor, bias: Tensor | None) -> None:
        self.linears = linears
        self.weight = weight  # [sum(out), in]
        self.bias = bias  # [sum(out)] or None
        self.fp8 = None  # an ddtree.models.fp8.Fp8Projection of the whole projection, attached by quantize_drafter
        self._pointers = self._current_pointers()

    @classmethod
    def fuse(cls, linears: tuple[nn.Linear, ...]) -> FusedLinear:
        weights = [lin.weight for lin in linears]
        first = weights[0]
        for lin in linears:
            if lin.weight.dtype != first.dtype or lin.weight.device != first.device:
                raise ShapeError(
                    f"cannot fuse projections with weights of {lin.weight.dtype} on {lin.weight.device} and "
                    f"{first.dtype} on {first.device}; move the model to one dtype and device first"
                )
            if (lin.bias is None) != (linears[0].bias is None):
                raise ShapeError("cannot fuse projections where only some have a bias")
        sizes = [w.shape[0] for w in weights]
        # never inference tensors (fusing inside inference_mode would leave parameters autograd refuses to train)
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([w.detach() for w in weights], dim=0)
            bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears], dim=0)
        for i, (lin, w_view) in enumerate(zip(linears, weight.split(sizes), strict=True)):
            lin.weight = nn.Parameter(w_view, requires_grad=lin.weight.requires_grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias.split(sizes)[i], requires_grad=lin.bias.requires_grad)
        return cls(linears, weight, bias)

    def _current_pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for lin in self.linears for p in (lin.weight, lin.bias) if p is not None)

    def intact(self) -> bool:
        """Whether every projection's parameters are still views of the fused tensors (the fused tensors are kept
        alive here, so a replaced parameter can never reuse their addresses)."""
        return self._current_pointers() == self._pointers

    def usable(self, x: Tensor) -> bool:
        """Intact, and autograd does not need the separate parameters for input ``x``."""
        return self.intact() and not grad_needed(x, *(lin.weight for lin in self.linears),
                                                  *(lin.bias for lin in self.linears))

    def __call__(self, x: Tensor, start: int = 0, *, kernels: bool = False) -> Tensor:
        """x [..., in] -> [..., sum(out) - start]: the fused projection from output row ``start`` on (a view of the
        weight, so projecting only k and v of q/k/v costs no copy). The whole projection goes through fp8 where
        an fp8 copy is attached and takes the call (``kernels``: its input quantised by the Triton kernel)."""
        bias = None if self.bias is None else self.bias[start:]
        if self.fp8 is not None and start == 0:
            return self.fp8(x, lambda: F.linear(x, self.weight, bias), kernel=kernels)
        return F.linear(x, self.weight[start:], bias)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: FusedLinear | None = None
        self.down_fp8 = None  # an fp8 copy of down_proj (ddtree.models.fp8.quantize_drafter), or None

    def fuse(self) -> None:
        """Back gate_proj and up_proj with one [2I, hidden] matrix (idempotent; re-fuses after ``.to()``)."""
        if self.gate_up is None or not self.gate_up.intact():
            self.gate_up = FusedLinear.fuse((self.gate_proj, self.up_proj))

    def fused_gate_up(self, x: Tensor) -> FusedLinear | None:
        """The fused gate/up projection when it may serve this call (see :meth:`FusedLinear.usable`)."""
        return self.gate_up if self.gate_up is not None and self.gate_up.usable(x) else None

    def forward(self, x: Tensor, *, kernels: bool = False) -> Tensor:
        """x [..., hidden] -> [..., hidden]. Fused: one matmul for gate and up, and with ``kernels`` (the caller's
        choice; used where :func:`~ddtree.triton_runtime.can_run` accepts ``x``) one Triton kernel for
        ``silu(gate) * up``."""
        fused = self.fused_gate_up(x)
        if fused is None:
            return self.down(F.silu(self.gate_proj(x)) * self.up_proj(x))
        kernels = kernels and can_run(x)
        gate_up = fused(x, kernels=kernels)  # [..., 2I]
        if kernels:
            return self.down(fused_ops.silu_mul(gate_up), kernels=True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def down(self, x: Tensor, *, kernels: bool = False) -> Tensor:
        """``down_proj(x)``, through the fp8 copy where one is attached and takes the call (``kernels``: its input
        quantised by the Triton kernel)."""
        if self.down_fp8 is None:
            return self.down_proj(x)
        return self.down_fp8(x, lambda: self.down_proj(x), kernel=kernels)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32, CPU) for plain, ``linear`` or ``llama3`` RoPE."""
    # on the CPU whatever the default device: on the meta device (every checkpoint load builds there) these ops go
    # through Python references that import torch._dynamo, seconds of a cold start
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
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
        default = torch.empty(0).device  # the device a model is built on (meta for a checkpoint load)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(default), persistent=False)

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
        self.qkv: FusedLinear | None = None
        self.o_fp8 = None  # an fp8 copy of o_proj (ddtree.models.fp8.quantize_drafter), or None

    def fuse(self) -> None:
        """Back q_proj, k_proj and v_proj with one [(H + 2 * KV) * D, hidden] matrix (idempotent; re-fuses after
        ``.to()`` or an assigning load)."""
        if self.qkv is None or not self.qkv.intact():
            self.qkv = FusedLinear.fuse((self.q_proj, self.k_proj, self.v_proj))

    def fused_qkv(self, x: Tensor) -> FusedLinear | None:
        """The fused projection when it may serve this call (see :meth:`FusedLinear.usable`)."""
        return self.qkv if self.qkv is not None and self.qkv.usable(x) else None

    def kernels_for(self, x: Tensor, kernels: bool) -> bool:
        """Whether the fused path runs the Triton kernels on ``x``: the caller chose them (``kernels``), they can
        run on ``x``, and autograd needs neither ``x`` nor the q/k norm weights (the kernels have no backward)."""
        weights = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        return kernels and can_run(x) and not grad_needed(x, *weights)

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor, *,
                    kernels: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """x [R, T, hidden] -> q [R, H, T, D], k, v [R, KV, T, D] (q, k normed and rotated). Fused: one matmul,
        and with ``kernels`` (where :meth:`kernels_for` allows) one Triton kernel for norms and RoPE."""
        fused = self.fused_qkv(x)
        if fused is None:
            k, v = self.project_kv(x, cos, sin)
            return self.project_q(x, cos, sin), k, v
        kernels = self.kernels_for(x, kernels)
        return self._norm_rope(fused(x, kernels=kernels), cos, sin, self.num_heads, kernels)

    def project_out(self, x: Tensor, *, kernels: bool = False) -> Tensor:
        """``o_proj(x)``, through the fp8 copy where one is attached and takes the call (``kernels``: its input
        quantised by the Triton kernel)."""
        if self.o_fp8 is None:
            return self.o_proj(x)
        return self.o_fp8(x, lambda: self.o_proj(x), kernel=kernels)

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [R, T, hidden] -> q [R, H, T, D] (normed, rotated)."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin).transpose(1, 2)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor, *,
                   kernels: bool = False) -> tuple[Tensor, Tensor]:
        """x [R, T, hidden] -> k, v [R, KV, T, D] (k normed and rotated). Fused: one matmul over the k/v rows
        of the fused weight (the drafter's context path projects no q), and with ``kernels`` (where
        :meth:`kernels_for` allows) one Triton kernel for the k norm and RoPE."""
        fused = self.fused_qkv(x)
        if fused is not None:
            kernels = self.kernels_for(x, kernels)
            _, k, v = self._norm_rope(fused(x, self.num_heads * self.head_dim), cos, sin, 0, kernels)
            return k, v
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def _norm_rope(self, qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int,
                   kernels: bool) -> tuple[Tensor, Tensor, Tensor]:
        """qkv [R, T, (num_heads + 2 * KV) * D] -> q [R, num_heads, T, D], k, v [R, KV, T, D]; ``kernels``
        already checked (:meth:`kernels_for`)."""
        kv, d = self.num_kv_heads, self.head_dim
        if kernels:
            q_w = None if self.q_norm is None else self.q_norm.weight
            k_w = None if self.k_norm is None else self.k_norm.weight
            eps = 0.0 if self.k_norm is None else self.k_norm.eps
            return fused_ops.qk_norm_rope(qkv, q_w, k_w, cos, sin, num_heads, kv, d, eps)
        q, k, v = qkv.unflatten(-1, (num_heads + 2 * kv, d)).split([num_heads, kv, kv], dim=-2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


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

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up (see :class:`FusedLinear`); idempotent."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attend: Attend, *, kernels: bool = False) -> Tensor:
        """h [R, T, hidden], cos/sin [R, T, D] -> [R, T, hidden]. kernels: a fused layer runs the Triton
        element-wise kernels where they can run (``KernelSet.fused_ops``); an unfused one ignores it (nothing to
        fuse into: the eager code is the reference)."""
        if self.self_attn.fused_qkv(h) is not None and self.mlp.fused_gate_up(h) is not None:
            return self._forward_fused(h, cos, sin, attend, kernels)
        x = self.input_layernorm(h)
        q = self.self_attn.project_q(x, cos, sin)
        k, v = self.self_attn.project_kv(x, cos, sin)
        out = attend(self.index, q, k, v)  # [R, H, T, D]
        h = h + self.self_attn.project_out(out.transpose(1, 2).flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))

    def _forward_fused(self, h: Tensor, cos: Tensor, sin: Tensor, attend: Attend, kernels: bool) -> Tensor:
        """The same maths with fused projections; with kernels: norm, qkv matmul, q/k norm + RoPE, attention,
        o_proj, residual add + norm, gate/up matmul, SwiGLU, down_proj, residual add."""
        attn, norm_in, norm_post = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        kernels = attn.kernels_for(h, kernels) and not grad_needed(h, norm_in.weight, norm_post.weight)
        x = fused_ops.rms_norm(h, norm_in.weight, norm_in.eps) if kernels else norm_in(h)
        q, k, v = attn.project_qkv(x, cos, sin, kernels=kernels)
        out = attend(self.index, q, k, v)  # [R, H, T, D]
        o = attn.project_out(out.transpose(1, 2).flatten(-2), kernels=kernels)
        if kernels:
            h, x = fused_ops.add_rms_norm(h, o, norm_post.weight, norm_post.eps)
        else:
            h = h + o
            x = norm_post(h)
        return h + self.mlp(x, kernels=kernels)


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every :class:`DecoderLayer` in ``model`` (a TargetModel, a DFlashDrafter, or
    anything holding layers) -> the number of layers fused. Call it after the model is loaded and placed: moving
    it afterwards (``.to()``) un-fuses it until this is called again.

    Only the weights' layout changes: whether a fused layer also runs the Triton element-wise kernels
    (:mod:`ddtree.models.fused_ops`) is each forward's ``kernels`` argument (the engine passes
    ``KernelSet.fused_ops``)."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.fuse_projections()
    return len(layers)
