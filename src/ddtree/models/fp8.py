"""fp8 (e4m3) projections for the DFlash drafter: half the bytes a draft reads.

Why: at one request the draft stage is the drafter reading its weights (2.1 GB for the Qwen3-8B DFlash body; 0.76
ms of a 5.9 ms DDTree round on the H200, docs/benchmarks.md), and ``torch._scaled_mm`` with one scale per tensor
runs a drafter layer's four GEMMs in 54 us instead of 103 (``benchmarks/fp8_gemm.py``, run 22). The drafter only
proposes tokens and the target verifies every one, so the drafter's precision can move acceptance, never a token of
the output: greedy decoding stays lossless.

Scales: one per weight tensor (its abs-max over 448), and one *static* scale per projection input, calibrated once
on a fixed text (:func:`calibrate`: the input's abs-max over the pass, times :data:`HEADROOM`, over 448; larger
values saturate at +-448). Why static: a scale per call needs a reduction over the whole activation before the
cast, kernels that cost more than the GEMM saves at one request; and a scale per row takes CUTLASS's rowwise GEMM,
no faster than bf16 at 16 rows (run 22). The weights keep their model-dtype copies too (the context append and any
call this path does not take use them), so fp8 adds half the drafter's size in memory.

Which calls: q/k/v and gate/up (the fused projections), o_proj and down_proj of every drafter layer, when the row
count is a multiple of 16 (cuBLASLt's fp8 rule; a draft block is 16 rows per request). The drafter's context append
(17 rows per request, run once per round) and its ``fc`` stay in the model dtype. Turned on by
``EngineConfig.draft_fp8``; the copies live on the drafter's modules, so engines sharing one drafter object must
agree on it (the engine refuses otherwise). A copy whose owner's weight is replaced or updated in place stops
serving calls; CUDA graphs captured before such a change keep reading the copy, as they keep reading every other
buffer they captured: rebuild the engine after changing weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ddtree.errors import ConfigError
from ddtree.models.layers import DecoderLayer, grad_needed
from ddtree.triton_runtime import FP_FUSION, can_run, tl, triton

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
HEADROOM = 2.0  # calibrated abs-max x HEADROOM maps to 448: inputs twice as large as any seen still fit
ROW_MULTIPLE = 16

if triton is not None:

    @triton.jit
    def _quantize_kernel(x_ptr, inv_scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """out = e4m3(clamp(x * inv_scale, -448, 448)), rounded once from fp32 (as the eager path)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        inv = tl.load(inv_scale_ptr)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        tl.store(out_ptr + offs, x.to(tl.float8e4nv), mask=mask)


def quantize(x: Tensor, inv_scale: Tensor, *, kernel: bool) -> Tensor:
    """x (contiguous) -> e4m3 of ``clamp(x * inv_scale, +-448)``; one Triton kernel where ``kernel`` (the eager
    path is four kernels). inv_scale: a one-element fp32 tensor on x's device."""
    if not kernel:
        return (x.float() * inv_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    out = torch.empty(x.shape, dtype=E4M3, device=x.device)
    n = x.numel()
    block = 1024
    _quantize_kernel[(triton.cdiv(n, block),)](x, inv_scale, out, n, BLOCK=block, enable_fp_fusion=FP_FUSION,
                                               num_warps=4)
    return out


def fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs fp8 here: CUDA devices of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell), or the CPU's reference implementation (tests)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _stamp(*tensors: Tensor | None) -> tuple:
    """Address and in-place version of each tensor. A replaced weight (``.to()``, an assigning load) changes the
    address; one updated in place (``load_state_dict``, an optimiser step) the version (views share their base's
    counter). Inference tensors keep no version counter, and refuse in-place updates outside inference mode."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        try:
            version = t._version
        except RuntimeError:
            version = None
        out.append((t.data_ptr(), version))
    return tuple(out)


class Fp8Projection:
    """One linear's weight in e4m3 with its scale, and its input's static scale (see the module docstring).

    ``owner`` is the ``nn.Linear`` or :class:`~ddtree.models.layers.FusedLinear` whose ``weight`` and ``bias`` this
    copies. It is kept so that a copy that no longer matches its owner's live weight (replaced, updated in place)
    turns itself off instead of serving stale values, and so that a deep copy of the model checks its own weights.
    Deliberately not an ``nn.Module``: nothing here belongs in ``state_dict()``."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self._stamp = _stamp(owner.weight, owner.bias)
        w = owner.weight.detach()
        self.out_features, self.in_features = w.shape
        # cuBLASLt's fp8 GEMM wants both dims of the weight a multiple of 16
        self.shape_ok = self.out_features % ROW_MULTIPLE == 0 and self.in_features % ROW_MULTIPLE == 0
        self.weight_scale = (w.abs().amax().float().clamp(min=1e-12) / E4M3_MAX).reshape(())
        # row-major [N, K] whatever the source's strides, so weight.t() is the column-major operand _scaled_mm wants
        self.weight = (w.float() / self.weight_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()
        self.bias = None if owner.bias is None else owner.bias.detach()
        self.input_scale = torch.ones((), dtype=torch.float32, device=w.device)
        self.inv_input_scale = torch.ones((), dtype=torch.float32, device=w.device)
        self.amax = 0.0  # the input's abs-max while calibrating
        self.calibrating = False
        self.calibrated = False

    def finish_calibration(self) -> None:
        """Fix the input scale from the abs-max seen while calibrating (in place: graphs may hold the tensors). An
        input that was exactly zero throughout (a zero-initialised layer) leaves the projection uncalibrated: its
        calls keep the model-dtype path."""
        self.calibrating = False
        if self.amax == float("inf"):
            raise ConfigError(f"fp8 calibration saw an infinite input to a {self.in_features}-wide projection; "
                              "the drafter overflows on the calibration text")
        if self.amax <= 0.0:
            return
        scale = max(self.amax * HEADROOM / E4M3_MAX, 1e-30)  # 1 / scale stays finite in fp32
        self.input_scale.fill_(scale)
        self.inv_input_scale.fill_(1.0 / scale)
        self.calibrated = True

    def accepts(self, x: Tensor) -> bool:
        """Calibrated, weight dims and rows multiples of 16, same device, autograd needs nothing (fp8 has no
        backward: neither ``x`` nor the owner's parameters may need grad) and the owner's weight unchanged."""
        return (self.calibrated and self.shape_ok and x.shape[-1] == self.in_features
                and x.device == self.weight.device and (x.numel() // self.in_features) % ROW_MULTIPLE == 0
                and not grad_needed(x, self.owner.weight, self.owner.bias) and self.intact())

    def intact(self) -> bool:
        """Whether the owner's weight and bias are still the tensors (and versions) this copies."""
        return _stamp(self.owner.weight, self.owner.bias) == self._stamp

    def __call__(self, x: Tensor, fallback: Callable[[], Tensor], *, kernel: bool = False) -> Tensor:
        """x [..., K] -> [..., N] in x's dtype through fp8, or ``fallback()`` (the model-dtype projection) for a
        call this path does not take; while calibrating, records x's abs-max and returns ``fallback()``.
        kernel: quantise the input with the Triton kernel where it can run (the caller's ``KernelSet.fused_ops``)."""
        if self.calibrating:
            self.amax = max(self.amax, float(x.detach().abs().amax()))
            return fallback()
        if not self.accepts(x):
            return fallback()
        rows = x.reshape(-1, self.in_features).contiguous()
        xq = quantize(rows, self.inv_input_scale, kernel=kernel and can_run(rows))
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                               out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _layers(drafter: nn.Module) -> list[DecoderLayer]:
    return [m for m in drafter.modules() if isinstance(m, DecoderLayer)]


def projections(drafter: nn.Module) -> Iterator[Fp8Projection]:
    """Every fp8 projection attached to ``drafter``'s layers."""
    for layer in _layers(drafter):
        attn, mlp = layer.self_attn, layer.mlp
        for p in (attn.qkv.fp8 if attn.qkv is not None else None, attn.o_fp8,
                  mlp.gate_up.fp8 if mlp.gate_up is not None else None, mlp.down_fp8):
            if p is not None:
                yield p


def quantize_drafter(drafter: nn.Module) -> int:
    """Attach fp8 copies of every layer's q/k/v, o, gate/up and down weights -> the number of layers. The layers
    must be fused first (:func:`~ddtree.models.layers.fuse_projections`); :func:`calibrate` must run before the
    fp8 path serves a call (until then every call takes the model-dtype projection).

    Idempotent: a copy whose weight is unchanged is kept, so a second engine over the same drafter does not free
    tensors the first one's CUDA graphs read."""
    def fresh(current: Fp8Projection | None) -> bool:
        return current is not None and current.intact()

    layers = _layers(drafter)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv is None or mlp.gate_up is None:
            raise ConfigError("quantize_drafter needs fused projections: call fuse_projections(drafter) first")
        if not fresh(attn.qkv.fp8):
            attn.qkv.fp8 = Fp8Projection(attn.qkv)
        if not fresh(attn.o_fp8):
            attn.o_fp8 = Fp8Projection(attn.o_proj)
        if not fresh(mlp.gate_up.fp8):
            mlp.gate_up.fp8 = Fp8Projection(mlp.gate_up)
        if not fresh(mlp.down_fp8):
            mlp.down_fp8 = Fp8Projection(mlp.down_proj)
    return len(layers)


@torch.inference_mode()
def calibrate(drafter: nn.Module, target: nn.Module, input_ids: Tensor) -> None:
    """Fix every fp8 projection's input scale from one training-style pass of ``drafter`` over ``input_ids``
    [1, T] (every anchored block of the sequence, with the target's features for it), T > the block size."""
    block = int(drafter.config.block_size)
    seq = input_ids.shape[1]
    if seq <= block:
        raise ConfigError(f"fp8 calibration needs more than {block} tokens, got {seq}")
    procs = list(projections(drafter))
    if not procs:
        raise ConfigError("calibrate: no fp8 projections; call quantize_drafter first")
    for p in procs:
        p.calibrating, p.amax = True, 0.0
    try:
        hidden = target.forward_train(input_ids, tuple(drafter.config.target_layer_ids), with_logits=False).hidden
        anchors = torch.arange(0, seq - block, max(1, block // 2), device=input_ids.device)[None]
        drafter.forward_train(target, input_ids, hidden, anchors, return_hidden=True)
    finally:
        for p in procs:
            p.calibrating = False
    for p in procs:
        p.finish_calibration()


# A calibration text: code and prose, so the drafter's activations span what it sees serving (the scale only
# needs each projection input's range; a few hundred tokens of mixed text reach it).
CALIBRATION_TEXT = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data = {}

    def get(self, key, default=None):
        if key not in self.data:
            return default
        value = self.data.pop(key)
        self.data[key] = value
        return value

    def put(self, key, value) -> None:
        self.data.pop(key, None)
        self.data[key] = value
        while len(self.data) > self.capacity:
            self.data.pop(next(iter(self.data)))


# Speculative decoding drafts several tokens cheaply and lets the large model check them all in one forward pass.
# When the draft is right, many tokens are accepted per step; when it is wrong, the output is still exactly what
# the large model alone would have produced, because every token is verified before it is committed.
for i in range(10):
    print(f"{i:3d} {i * i:5d} {merge_intervals([(i, i + 2), (i + 1, i + 3)])}")
'''
