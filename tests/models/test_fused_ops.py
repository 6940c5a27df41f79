"""Fused decoder-layer kernels against the eager layer code, and fused projections against separate ones.

Without a GPU the Triton kernels run on CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before ddtree is imported; every test here runs inside ``triton_runtime.cpu_interpreter()``), which is slow: shapes
stay tiny. The interpreter converts fp32 to bf16 by truncation
where a GPU rounds to nearest, so bf16 results are compared within a few bf16 ulps; fp32 and fp16 are tight.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from model_helpers import perturb_, random_drafter, random_target, rel_err

pytest.importorskip("triton")

from ddtree import triton_runtime  # noqa: E402
from ddtree.engine.kernels import KernelSet  # noqa: E402
from ddtree.errors import ShapeError  # noqa: E402
from ddtree.models import fused_ops, load_target, save_target  # noqa: E402
from ddtree.models.layers import (  # noqa: E402
    DecoderLayer,
    FusedLinear,
    RMSNorm,
    Rotary,
    apply_rope,
    fuse_projections,
    masked_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and not triton_runtime.INTERPRETED:
    pytest.skip("no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 must be set before import)",
                allow_module_level=True)

# (rtol, atol) per dtype: fp32 and fp16 differ from eager only in reduction order and rsqrt. bf16 on a GPU rounds
# where eager rounds (an ulp at most); under the interpreter every cast to bf16 truncates, and q/k norm + RoPE
# chains four such casts, with cancellation in the RoPE sums: a few ulps at the operands' magnitude (~4).
BF16_TOL = (2**-7, 2**-7) if DEVICE == "cuda" else (2**-5, 2**-4)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: BF16_TOL}
DTYPES = list(TOL)


@pytest.fixture(autouse=True)
def _interpret():
    """Let the kernels run on CPU tensors through the interpreter (changes nothing for CUDA tensors)."""
    with triton_runtime.cpu_interpreter():
        yield


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every float tensor torch.empty returns starts as NaN, so an output element a kernel forgot stays NaN."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def norm_module(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = 1.0 + rand(dim, dtype=dtype, seed=seed, scale=0.1)
    return norm


# --- kernels ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 256])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_matches_eager(dtype, dim, tokens, poisoned_empty):
    norm = norm_module(dim, dtype, seed=1)
    x = rand(2, tokens, dim, dtype=dtype, seed=2, scale=3.0)
    close(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))


def test_rms_norm_strided_rows_and_promoted_weight(poisoned_empty):
    """Rows further apart than D (a slice of a wider tensor) and an fp32 weight on bf16 input, which eager
    promotes to an fp32 result."""
    wide = rand(3, 5, 200, dtype=torch.bfloat16, seed=3)
    x = wide[..., 40:136]  # [3, 5, 96], row stride 200
    norm = norm_module(96, torch.float32, seed=4)
    out = fused_ops.rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, norm(x), rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 256])
def test_add_rms_norm_matches_eager(dtype, dim, poisoned_empty):
    norm = norm_module(dim, dtype, seed=5)
    residual = rand(2, 7, dim, dtype=dtype, seed=6, scale=2.0)
    x = rand(2, 7, dim, dtype=dtype, seed=7)
    h, normed = fused_ops.add_rms_norm(residual, x, norm.weight, norm.eps)
    h_ref = residual + x
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        close(h, h_ref)  # the interpreter truncates to bf16
    else:
        assert torch.equal(h, h_ref)  # one rounded add, exactly as torch's
    close(normed, norm(h_ref))


def eager_qk_norm_rope(qkv, q_norm, k_norm, cos, sin, heads, kv, d):
    q, k, v = qkv.unflatten(-1, (heads + 2 * kv, d)).split([heads, kv, kv], dim=-2)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_matches_eager(dtype, head_dim, tokens, qk_norm, poisoned_empty):
    heads, kv, rows = 4, 2, 2
    qkv = rand(rows, tokens, (heads + 2 * kv) * head_dim, dtype=dtype, seed=8, scale=2.0)
    positions = torch.randint(0, 300, (rows, tokens), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    cos, sin = Rotary(head_dim, 10000.0, None).to(DEVICE)(positions, dtype)
    q_norm = norm_module(head_dim, dtype, seed=10) if qk_norm else None
    k_norm = norm_module(head_dim, dtype, seed=11) if qk_norm else None
    q, k, v = fused_ops.qk_norm_rope(qkv, q_norm and q_norm.weight, k_norm and k_norm.weight, cos, sin, heads, kv,
                                     head_dim, 1e-6)
    q_ref, k_ref, v_ref = eager_qk_norm_rope(qkv, q_norm, k_norm, cos, sin, heads, kv, head_dim)
    assert q.shape == (rows, heads, tokens, head_dim) and k.shape == (rows, kv, tokens, head_dim)
    close(q, q_ref)
    close(k, k_ref)
    assert torch.equal(v, v_ref)


def test_qk_norm_rope_without_q_heads_projects_kv_only(poisoned_empty):
    """H = 0: the drafter's context path, where the fused projection covers only k and v."""
    kv, d = 2, 16
    kvx = rand(3, 5, 2 * kv * d, dtype=torch.float32, seed=12)
    cos, sin = Rotary(d, 10000.0, None).to(DEVICE)(torch.arange(15, device=DEVICE).view(3, 5), torch.float32)
    k_norm = norm_module(d, torch.float32, seed=13)
    q, k, v = fused_ops.qk_norm_rope(kvx, k_norm.weight, k_norm.weight, cos, sin, 0, kv, d, 1e-6)
    _, k_ref, v_ref = eager_qk_norm_rope(kvx, k_norm, k_norm, cos, sin, 0, kv, d)
    assert q.shape == (3, 0, 5, d)
    close(k, k_ref)
    assert torch.equal(v, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1500])  # 1500: two column blocks, the second masked
@pytest.mark.parametrize("tokens", [1, 7])
def test_silu_mul_matches_eager(dtype, inter, tokens, poisoned_empty):
    gate_up = rand(2, tokens, 2 * inter, dtype=dtype, seed=14, scale=3.0)
    expected = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    close(fused_ops.silu_mul(gate_up), expected)


def test_empty_inputs_launch_nothing():
    w = torch.ones(8, device=DEVICE)
    assert fused_ops.rms_norm(torch.empty(0, 8, device=DEVICE), w, 1e-6).shape == (0, 8)
    assert fused_ops.silu_mul(torch.empty(2, 0, 6, device=DEVICE)).shape == (2, 0, 3)
    cos = torch.empty(1, 0, 8, device=DEVICE)
    q, k, _ = fused_ops.qk_norm_rope(torch.empty(1, 0, 32, device=DEVICE), None, None, cos, cos, 2, 1, 8, 0.0)
    assert q.shape == (1, 2, 0, 8) and k.shape == (1, 1, 0, 8)


def test_bad_arguments_name_the_problem():
    x = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ShapeError, match="last dim 8"):
        fused_ops.rms_norm(x, torch.ones(6, device=DEVICE), 1e-6)
    with pytest.raises(ShapeError, match="float64"):
        fused_ops.rms_norm(x.double(), torch.ones(8, device=DEVICE), 1e-6)
    cos = torch.zeros(2, 3, 4, device=DEVICE)
    with pytest.raises(ShapeError, match="num_heads 2"):
        fused_ops.qk_norm_rope(x, None, None, cos, cos, 2, 1, 4, 1e-6)
    with pytest.raises(ShapeError, match="odd"):
        fused_ops.qk_norm_rope(torch.zeros(2, 3, 9, device=DEVICE), None, None, cos, cos, 1, 1, 3, 1e-6)
    with pytest.raises(ShapeError, match="even last dim"):
        fused_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))


def test_can_run_follows_the_device_and_the_cpu_interpreter():
    cpu = torch.zeros(1)
    assert triton_runtime.triton is not None
    if triton_runtime.INTERPRETED:
        assert triton_runtime.can_run(cpu)  # inside the autouse cpu_interpreter()
        with triton_runtime.cpu_interpreter(False):
            assert not triton_runtime.can_run(cpu)
            with triton_runtime.cpu_interpreter():
                assert triton_runtime.can_run(cpu)
            assert not triton_runtime.can_run(cpu)
        assert triton_runtime.can_run(cpu)
        assert not triton_runtime.can_run(torch.zeros(1, device="meta"))
    else:  # compiled kernels (a GPU machine): CUDA tensors only, the context changes nothing
        assert triton_runtime.can_run(torch.zeros(1, device=DEVICE)) and not triton_runtime.can_run(cpu)
        with triton_runtime.cpu_interpreter(False):
            assert triton_runtime.can_run(torch.zeros(1, device=DEVICE))


# --- fused projections and the fused layer -----------------------------------------------------------------------


def random_layer(*, qk_norm: bool, qkv_bias: bool, seed: int) -> DecoderLayer:
    layer = DecoderLayer(0, 32, 40, 4, 2, 8, 1e-6, qkv_bias=qkv_bias, o_bias=False, qk_norm=qk_norm)
    perturb_(layer, seed)
    return layer.to(DEVICE).eval()


def causal_attend(layer: int, q, k, v):
    return masked_attention(q, k, v, None, causal=True)


def count_calls(monkeypatch, *names: str) -> dict[str, int]:
    """Wrap fused_ops kernels so a test can prove the fused path really ran them."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(fused_ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused_ops, name, counted)
    return calls


def test_fuse_makes_projection_weights_views_and_keeps_names():
    layer = random_layer(qk_norm=True, qkv_bias=True, seed=0)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.fuse_projections()
    attn, mlp = layer.self_attn, layer.mlp
    fused = attn.qkv.weight
    assert fused.shape == ((4 + 2 * 2) * 8, 32)
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert lin.bias.untyped_storage().data_ptr() == attn.qkv.bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up.weight.untyped_storage().data_ptr()
    after = layer.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    layer.fuse_projections()  # idempotent: the same fused tensors
    assert attn.qkv.weight is fused


def test_in_place_load_updates_the_fused_weight_and_a_move_unfuses():
    layer = random_layer(qk_norm=True, qkv_bias=False, seed=1)
    layer.fuse_projections()
    other = random_layer(qk_norm=True, qkv_bias=False, seed=2)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer.self_attn.qkv.weight[:32], other.self_attn.q_proj.weight)
    assert torch.equal(layer.mlp.gate_up.weight[40:], other.mlp.up_proj.weight)
    h = rand(2, 5, 32, dtype=torch.float32, seed=3)
    cos, sin = Rotary(8, 10000.0, None).to(DEVICE)(torch.arange(5, device=DEVICE).expand(2, -1), torch.float32)
    expected = other(h, cos, sin, causal_attend)
    moved = layer.double()  # replaces every parameter: the fused tensors no longer back the projections
    assert not moved.self_attn.qkv.intact() and moved.self_attn.fused_qkv(h) is None
    assert rel_err(moved(h.double(), cos.double(), sin.double(), causal_attend).float(), expected) < 1e-5
    moved.fuse_projections()
    assert moved.self_attn.qkv.intact() and moved.self_attn.qkv.weight.dtype == torch.float64


@pytest.mark.parametrize("qk_norm,qkv_bias", [(True, False), (False, True)])
@pytest.mark.parametrize("kernels", [False, True])
def test_fused_layer_equals_unfused(qk_norm, qkv_bias, kernels, monkeypatch):
    layer = random_layer(qk_norm=qk_norm, qkv_bias=qkv_bias, seed=4)
    h = rand(2, 7, 32, dtype=torch.float32, seed=5)
    cos, sin = Rotary(8, 10000.0, None).to(DEVICE)(torch.arange(3, 17, 2, device=DEVICE).expand(2, -1),
                                                  torch.float32)
    expected = layer(h, cos, sin, causal_attend)
    fuse_projections(layer)
    calls = count_calls(monkeypatch, "rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul")
    out = layer(h, cos, sin, causal_attend, kernels=kernels)
    assert calls == dict.fromkeys(calls, int(kernels))
    assert rel_err(out, expected) < 1e-5


def test_kernels_chosen_but_unable_to_run_fall_back_to_eager(monkeypatch):
    """kernels=True on CPU tensors outside cpu_interpreter() (on any machine): the fused matmuls with the eager
    element-wise code, no kernel launched."""
    layer = random_layer(qk_norm=True, qkv_bias=False, seed=4).cpu()
    h = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(5))
    cos, sin = Rotary(8, 10000.0, None)(torch.arange(7).expand(2, -1), torch.float32)
    expected = layer(h, cos, sin, causal_attend)
    fuse_projections(layer)
    calls = count_calls(monkeypatch, "rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul")
    with triton_runtime.cpu_interpreter(False):
        out = layer(h, cos, sin, causal_attend, kernels=True)
    assert calls == dict.fromkeys(calls, 0)
    assert layer.self_attn.fused_qkv(h) is not None  # the fused projections did serve the call
    assert rel_err(out, expected) < 1e-5


def test_training_keeps_gradients_on_the_separate_parameters():
    """With autograd on, a fused layer must run the separate projections (the fused tensor has no graph edge to
    the parameters), so gradients equal an unfused twin's."""
    layer = random_layer(qk_norm=True, qkv_bias=True, seed=6)
    twin = copy.deepcopy(layer)
    layer.fuse_projections()
    h = rand(1, 4, 32, dtype=torch.float32, seed=7)
    cos, sin = Rotary(8, 10000.0, None).to(DEVICE)(torch.arange(4, device=DEVICE)[None], torch.float32)
    with torch.enable_grad():
        for model in (layer, twin):
            model(h, cos, sin, causal_attend).square().sum().backward()
    for (name, p), q in zip(layer.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    s = torch.arange(seq, device=DEVICE)
    return (s[None, :] <= s[:, None]).expand(batch, -1, -1)


def target_logits(model, ids: torch.Tensor, kernels: KernelSet | None = None) -> torch.Tensor:
    batch, seq = ids.shape
    cache = model.allocate_cache(batch, seq)
    pos = torch.arange(seq, device=DEVICE).expand(batch, -1)
    return model(ids, pos, cache, torch.arange(batch, device=DEVICE), pos, causal_mask(batch, seq),
                 kernels=kernels).logits


FUSED_OPS = replace(KernelSet.torch(), fused_ops=True)  # the layers' element-wise kernels, nothing else


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fused_target_equals_unfused_and_saves_original_names(family, tmp_path, monkeypatch):
    overrides = {} if family == "qwen3" else dict(family="qwen2", qk_norm=False, attention_bias=True)
    model = random_target(**overrides).to(DEVICE)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    expected = target_logits(model, ids)
    calls = count_calls(monkeypatch, "rms_norm", "qk_norm_rope")
    assert fuse_projections(model) == model.config.num_layers
    assert rel_err(target_logits(model, ids, KernelSet.torch()), expected) < 1e-5  # fused matmuls, eager element-wise
    assert calls == {"rms_norm": 0, "qk_norm_rope": 0}
    assert rel_err(target_logits(model, ids, FUSED_OPS), expected) < 1e-5  # fused_ops: Triton kernels too
    layers = model.config.num_layers
    assert calls == {"rms_norm": layers, "qk_norm_rope": layers}
    save_target(model, tmp_path)
    loaded = load_target(tmp_path, device=DEVICE)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert rel_err(target_logits(loaded, ids), expected) < 1e-5


def test_fused_drafter_context_and_drafts_equal_unfused():
    target = random_target().to(DEVICE)
    drafter = random_drafter().to(DEVICE)
    fused = copy.deepcopy(drafter)
    assert fuse_projections(fused) == drafter.config.num_layers
    ids = torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    features = target.forward_train(ids, drafter.config.target_layer_ids).hidden
    pos = torch.arange(6, device=DEVICE)[None]
    slot = torch.tensor([0], device=DEVICE)
    outs, caches = [], []
    for model, kernels in ((drafter, None), (fused, FUSED_OPS)):
        cache = model.allocate_cache(1, 12)
        model.append_context(features, pos, cache, slot, pos, kernels=kernels)
        outs.append(model.draft_logits(target, ids[:, 5], torch.tensor([5], device=DEVICE), cache, slot, 4,
                                       kernels=kernels))
        caches.append(cache)
    assert rel_err(caches[1].k, caches[0].k) < 1e-5 and rel_err(caches[1].v, caches[0].v) < 1e-5
    assert rel_err(outs[1], outs[0]) < 1e-5


def test_fused_linear_projects_from_a_row_offset():
    lins = tuple(torch.nn.Linear(6, n, bias=True).to(DEVICE) for n in (4, 3, 3))
    x = rand(2, 6, dtype=torch.float32, seed=10)
    expected = torch.cat([lin(x) for lin in lins], dim=-1)
    fused = FusedLinear.fuse(lins)
    torch.testing.assert_close(fused(x), expected)
    torch.testing.assert_close(fused(x, 4), expected[:, 4:])
