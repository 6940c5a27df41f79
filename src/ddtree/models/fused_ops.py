"""Triton kernels for the decoder layer's small element-wise steps, with the eager code's exact rounding order.

Why: inside a CUDA graph every kernel still costs 2-4 us, and the eager layer issues ~75 of them (RMSNorm alone is
float, pow, mean, add, rsqrt, mul, cast, weight-mul). These kernels do each step in one pass:

    rms_norm       x                      -> weight * norm(x)                     (input_layernorm)
    add_rms_norm   residual, x            -> h = residual + x, weight * norm(h)   (residual + post_attention_layernorm)
    qk_norm_rope   qkv (fused projection) -> q, k normed per head and rotated; v a view
    silu_mul       gate_up (fused proj.)  -> silu(gate) * up

Each kernel rounds where the eager PyTorch code rounds (a bf16 product is computed in fp32 and rounded once, as
PyTorch's element-wise ops do), so bf16 results differ from eager only through the fp32 reduction order and rsqrt.

When they run is decided outside this module: a fused layer's forward given ``kernels=True`` (the engine's
``KernelSet.fused_ops``) calls them when :func:`ddtree.triton_runtime.can_run` accepts its input (CUDA; CPU tensors only under Triton's interpreter
inside ``triton_runtime.cpu_interpreter()``, which tests use). Without Triton the layers run their eager code and
calling a kernel here raises :class:`~ddtree.errors.ConfigError`; a tensor a kernel cannot take (shape, dtype)
raises :class:`~ddtree.errors.ShapeError`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.errors import ConfigError, ShapeError
from ddtree.triton_runtime import FP_FUSION, masked_if, tl, triton

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Kernels. Defined only where Triton imports; program ids are widened to int64 so row offsets cannot overflow.

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, h_ptr, out_ptr, stride_x, stride_res, stride_h, stride_out, n_cols,
                         eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """One program per row. With HAS_RESIDUAL: h = round(res + x) is stored and normalised; otherwise h is x
        (h_ptr aliases x_ptr and only its dtype is used)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            h = (res.to(tl.float32) + x.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
            x32 = h.to(tl.float32)
        else:
            x32 = x.to(tl.float32)
        mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.rsqrt(mean_sq + eps)).to(h_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = normed.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, n_tokens, n_heads, n_kv,
                             stride_qkv_r, stride_qkv_t, stride_cos_r, stride_cos_t, stride_sin_r, stride_sin_t,
                             eps, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
                             NORM_DTYPE: tl.constexpr):
        """Program (row * T + token, head) with head in 0 .. H + KV - 1 (q heads first, as in the fused
        projection). Loads the head as two halves so ``rotate_half`` needs no shuffle. Both weight vectors are
        loaded and both outputs addressed, one store masked off: no divergent control flow."""
        rt = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        r = rt // n_tokens
        t = rt % n_tokens
        cols = tl.arange(0, BLOCK)
        mask = cols < HALF
        src = qkv_ptr + r * stride_qkv_r + t * stride_qkv_t + head * (2 * HALF)
        x1 = tl.load(src + cols, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
        is_q = head < n_heads
        if HAS_NORM:
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
            qw1 = tl.load(qw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            qw2 = tl.load(qw_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            kw1 = tl.load(kw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            kw2 = tl.load(kw_ptr + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            w1 = tl.where(is_q, qw1, kw1)
            w2 = tl.where(is_q, qw2, kw2)
            y1 = ((a * inv).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w1).to(NORM_DTYPE).to(tl.float32)
            y2 = ((b * inv).to(qkv_ptr.dtype.element_ty).to(tl.float32) * w2).to(NORM_DTYPE).to(tl.float32)
        else:
            y1 = x1.to(tl.float32)
            y2 = x2.to(tl.float32)
        cs = cos_ptr + r * stride_cos_r + t * stride_cos_t
        sn = sin_ptr + r * stride_sin_r + t * stride_sin_t
        c1 = tl.load(cs + cols, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sn + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sn + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        out_ty = q_ptr.dtype.element_ty
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounded as eager rounds it
        o1 = (y1 * c1).to(out_ty).to(tl.float32) - (y2 * s1).to(out_ty).to(tl.float32)
        o2 = (y2 * c2).to(out_ty).to(tl.float32) + (y1 * s2).to(out_ty).to(tl.float32)
        q_dst = q_ptr + ((r * n_heads + head) * n_tokens + t) * (2 * HALF)
        k_dst = k_ptr + ((r * n_kv + head - n_heads) * n_tokens + t) * (2 * HALF)
        is_k = head >= n_heads
        tl.store(q_dst + cols, o1.to(out_ty), mask=masked_if(is_q, mask))
        tl.store(q_dst + HALF + cols, o2.to(out_ty), mask=masked_if(is_q, mask))
        tl.store(k_dst + cols, o1.to(out_ty), mask=masked_if(is_k, mask))
        tl.store(k_dst + HALF + cols, o2.to(out_ty), mask=masked_if(is_k, mask))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
        """Program (row, column block): out[:, j] = round(round(silu(gate[j])) * up[j]), gate = x[:, :I]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * u).to(out_ty), mask=mask)

    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# Wrappers: check shapes once, allocate outputs, launch. No host syncs and no value-dependent allocation, so every
# wrapper can run inside CUDA-graph capture (after a warm-up call has compiled its kernel).


def _need_triton() -> None:
    if triton is None:
        raise ConfigError("the fused kernels need Triton; install it (pip install triton) or leave them disabled")


def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in _SUPPORTED:
        raise ShapeError(f"{name} has dtype {t.dtype}; the fused kernels take float32, float16 or bfloat16")


def _rows(x: Tensor, width: int) -> Tensor:
    """[..., width] -> [rows, width] with a unit last stride (a view when the layout allows it)."""
    flat = x.reshape(-1, width)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _norm_warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` [..., D], in the
    dtype eager PyTorch gives that product (the promotion of x's and weight's)."""
    _need_triton()
    return _launch_norm(None, x, weight, eps)[1]


def add_rms_norm(residual: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual, x [..., D], weight [D] -> (h, rms_norm(h)), h = residual + x rounded to the promoted dtype."""
    _need_triton()
    if residual.shape != x.shape:
        raise ShapeError(f"add_rms_norm: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    h, out = _launch_norm(residual, x, weight, eps)
    assert h is not None
    return h, out


def _launch_norm(residual: Tensor | None, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor | None, Tensor]:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ShapeError(f"norm weight shape {tuple(weight.shape)} does not match the last dim {width} of x")
    _check_dtype("x", x)
    _check_dtype("weight", weight)
    h_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    h = None if residual is None else torch.empty(x.shape, dtype=h_dtype, device=x.device)
    if x.numel() == 0:
        return h, out
    xr = _rows(x, width)
    out_rows = out.view(-1, width)
    if residual is None:
        res_rows, h_rows = xr, xr
    else:
        _check_dtype("residual", residual)
        res_rows, h_rows = _rows(residual, width), h.view(-1, width)
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(xr.shape[0],)](
        xr, res_rows, weight.contiguous(), h_rows, out_rows, xr.stride(0), res_rows.stride(0), h_rows.stride(0),
        out_rows.stride(0), width, eps, BLOCK=block, HAS_RESIDUAL=residual is not None,
        enable_fp_fusion=FP_FUSION, num_warps=_norm_warps(block),
    )
    return h, out


def qk_norm_rope(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor, sin: Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection's output -> attention inputs, in one kernel for q and k.

    qkv [R, T, (H + 2 * KV) * D] (q heads, then k heads, then v heads); q_weight/k_weight [D] per-head RMSNorm
    weights (Qwen3) or both None (Qwen2/Llama); cos/sin [R, T, D] as :class:`~ddtree.models.layers.Rotary`
    returns them. Returns q [R, H, T, D] and k [R, KV, T, D] (normed, then rotated the ``rotate_half`` way,
    contiguous) and v [R, KV, T, D], a view into ``qkv``. H may be 0 (k/v of the drafter's context)."""
    _need_triton()
    r, t, width = qkv.shape
    d = head_dim
    if width != (num_heads + 2 * num_kv_heads) * d:
        raise ShapeError(
            f"qkv last dim {width} != (num_heads {num_heads} + 2 * num_kv_heads {num_kv_heads}) * head_dim {d}"
        )
    if d % 2:
        raise ShapeError(f"head_dim {d} is odd; rotate_half RoPE needs an even head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ShapeError("qk_norm_rope takes both q_weight and k_weight (Qwen3) or neither (Qwen2/Llama)")
    if cos.shape != (r, t, d) or sin.shape != (r, t, d):
        raise ShapeError(f"cos/sin shapes {tuple(cos.shape)}/{tuple(sin.shape)}, expected {(r, t, d)}")
    for name, tensor in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        _check_dtype(name, tensor)
    has_norm = q_weight is not None
    norm_dtype = qkv.dtype
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            _check_dtype(name, w)
            if w.shape != (d,):
                raise ShapeError(f"{name} shape {tuple(w.shape)}, expected ({d},)")
        norm_dtype = torch.promote_types(qkv.dtype, torch.promote_types(q_weight.dtype, k_weight.dtype))
    out_dtype = torch.promote_types(torch.promote_types(norm_dtype, cos.dtype), sin.dtype)
    q = torch.empty((r, num_heads, t, d), dtype=out_dtype, device=qkv.device)
    k = torch.empty((r, num_kv_heads, t, d), dtype=out_dtype, device=qkv.device)
    v = qkv[..., (num_heads + num_kv_heads) * d:].unflatten(-1, (num_kv_heads, d)).transpose(1, 2)
    if r * t == 0 or num_heads + num_kv_heads == 0:
        return q, k, v
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    qw = q_weight.contiguous() if has_norm else qkv
    kw = k_weight.contiguous() if has_norm else qkv
    half = d // 2
    _qk_norm_rope_kernel[(r * t, num_heads + num_kv_heads)](
        qkv, qw, kw, cos, sin, q, k, t, num_heads, num_kv_heads, qkv.stride(0), qkv.stride(1), cos.stride(0),
        cos.stride(1), sin.stride(0), sin.stride(1), eps, HALF=half, BLOCK=triton.next_power_of_2(half),
        HAS_NORM=has_norm, NORM_DTYPE=_TL_DTYPES[norm_dtype], enable_fp_fusion=FP_FUSION,
        num_warps=1 if half <= 128 else 2,
    )
    return q, k, v


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2I] (gate first, up second) -> ``silu(gate) * up`` [..., I] in gate_up's dtype."""
    _need_triton()
    _check_dtype("gate_up", gate_up)
    width = gate_up.shape[-1]
    if width % 2:
        raise ShapeError(f"silu_mul needs an even last dim (gate then up), got {width}")
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = _rows(gate_up, width)
    out_rows = out.view(-1, inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out_rows, inter, rows.stride(0), out_rows.stride(0), BLOCK=block, enable_fp_fusion=FP_FUSION,
        num_warps=4 if block >= 512 else 2,
    )
    return out
