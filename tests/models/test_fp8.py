"""fp8 drafter projections (ddtree.models.fp8): the arithmetic against a dequantised reference, the calls that must
fall back to the model-dtype projection, calibration, and an engine with an fp8 drafter staying lossless."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_drafter, random_target

from ddtree.errors import ConfigError
from ddtree.models import fp8, fuse_projections


def _linear(n: int, k: int, seed: int = 0) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
    return lin


def _projection(n: int = 48, k: int = 32, seed: int = 0) -> tuple[torch.Tensor, fp8.Fp8Projection]:
    lin = _linear(n, k, seed)
    proj = fp8.Fp8Projection(lin)
    proj.calibrating = True
    proj(torch.randn(16, k, generator=torch.Generator().manual_seed(seed + 1)) * 3.0, lambda: None)  # abs-max
    proj.finish_calibration()
    return lin.weight.detach(), proj


def test_projection_equals_the_dequantised_reference_and_stays_near_the_exact_one():
    w, proj = _projection()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    out = proj(x, lambda: pytest.fail("a calibrated 32-row call must take the fp8 path"))
    # independent reference: quantise both operands by hand (round to nearest e4m3), multiply in float64
    xq = (x.double() / proj.input_scale.double()).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    wq = (w.double() / proj.weight_scale.double()).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    ref = (xq * proj.input_scale.double()) @ (wq * proj.weight_scale.double()).T
    assert out.shape == (2, 16, 48) and out.dtype == x.dtype
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    exact = F.linear(x, w)
    assert (out - exact).norm() / exact.norm() < 0.08  # e4m3 keeps 3 mantissa bits


def test_calibration_sets_the_scale_and_larger_inputs_saturate_instead_of_overflowing():
    _, proj = _projection()
    amax = proj.amax
    assert proj.input_scale.item() == pytest.approx(amax * fp8.HEADROOM / 448.0)
    big = torch.full((16, 32), 100.0 * amax)
    out = proj(big, lambda: pytest.fail("must take the fp8 path"))
    assert torch.isfinite(out).all()
    clipped = torch.full((16, 32), fp8.HEADROOM * amax)  # saturates at 448 * scale = HEADROOM * amax
    assert torch.allclose(out, proj(clipped, lambda: None))
    zero = fp8.Fp8Projection(_linear(16, 16))
    zero.finish_calibration()  # never saw a non-zero input (a zero-initialised layer): keeps the exact path
    assert not zero.calibrated
    zero.amax = float("inf")
    with pytest.raises(ConfigError, match="infinite input"):
        zero.finish_calibration()


@pytest.mark.parametrize("case", ["uncalibrated", "rows", "grad", "trainable", "replaced", "updated", "odd_weight"])
def test_calls_the_fp8_path_cannot_take_get_the_exact_projection(case):
    lin = _linear(48, 32)
    proj = fp8.Fp8Projection(lin)
    proj.amax = 1.0
    proj.finish_calibration()
    x = torch.randn(16, 32)
    if case == "uncalibrated":
        proj = fp8.Fp8Projection(lin)
    elif case == "rows":
        x = torch.randn(17, 32)  # not a multiple of 16 rows
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "trainable":
        lin.weight.requires_grad_(True)  # training the layer: its gradient must not be cut off
    elif case == "replaced":
        lin.weight = torch.nn.Parameter(lin.weight.detach().clone())  # what .to() or an assigning load does
    elif case == "updated":
        with torch.no_grad():
            lin.weight.mul_(0.5)  # what load_state_dict or an optimiser step does
    elif case == "odd_weight":
        proj = fp8.Fp8Projection(_linear(40, 32))
        proj.amax = 1.0
        proj.finish_calibration()
    sentinel = torch.zeros(1)
    with torch.enable_grad():  # this directory's tests run under no_grad (its conftest); training does not
        assert proj(x, lambda: sentinel) is sentinel
    if case in ("rows", "grad", "trainable"):  # the same projection still serves a call it can take
        assert proj(torch.randn(16, 32), lambda: sentinel) is not sentinel


def test_quantize_drafter_attaches_every_projection_and_calibrates_them():
    target, drafter = random_target(), random_drafter(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                                      intermediate_size=32, block_size=4)
    with pytest.raises(ConfigError, match="fuse_projections"):
        fp8.quantize_drafter(drafter)
    fuse_projections(drafter)
    assert fp8.quantize_drafter(drafter) == 2
    procs = list(fp8.projections(drafter))
    assert len(procs) == 8 and not any(p.calibrated for p in procs)
    ids = torch.randint(0, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    fp8.calibrate(drafter, target, ids)
    assert all(p.calibrated and p.input_scale.item() > 0 for p in procs)
    fp8.quantize_drafter(drafter)  # again: unchanged weights keep their (calibrated) copies
    assert list(fp8.projections(drafter)) == procs
    twin = copy.deepcopy(drafter)  # a deep copy checks its own weights, not the original's
    twin.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(twin.layers[0].self_attn.o_proj.weight * 2)
    assert not twin.layers[0].self_attn.o_fp8.intact() and drafter.layers[0].self_attn.o_fp8.intact()
    layer = drafter.layers[0]
    layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight.detach().clone())
    fp8.quantize_drafter(drafter)  # a replaced weight gets a new, uncalibrated copy
    assert layer.mlp.down_fp8 not in procs and not layer.mlp.down_fp8.calibrated
    with pytest.raises(ConfigError, match="more than 4 tokens"):
        fp8.calibrate(drafter, target, ids[:, :4])


def test_engine_with_an_fp8_drafter_is_lossless_and_uses_fp8(tiny_pair, tiny_tokenizer, monkeypatch):
    from ddtree.engine import Engine, EngineConfig

    rows = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: rows.append(a[0].shape[0]) or real(*a, **k))
    target, drafter = tiny_pair
    own = copy.deepcopy(drafter)  # the session's shared drafter must not get fp8 copies attached
    config = EngineConfig(max_batch=4, max_len=256, max_budget=16, draft_fp8=True)
    engine = Engine.from_models(target, own, tiny_tokenizer, config, model_name="fp8")
    engine.start()
    try:
        _assert_chain_and_tree_equal_ar(engine)
        # the tiny drafter's block is 8 rows a request: batches of an even size took fp8 (every layer's four
        # projections), odd ones fell back; the target never did
        assert len(rows) >= 4 * len(own.layers) and not list(fp8.projections(target))
    finally:
        engine.shutdown(drain_timeout=0)


def _assert_chain_and_tree_equal_ar(engine) -> None:
    """Greedy DFlash-chain and DDTree outputs of 4 prompts (batched, so block row counts vary) equal AR's."""
    from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings

    prompts = [[5, 9, 11, 3, 7, 2, 8, 4][: 3 + i] * 3 for i in range(4)]
    outs = {}
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 8)):
        reqs = [GenerationRequest(prompt_token_ids=p, tree=TreeSettings(method=method, budget=budget),
                                  sampling=SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
        outs[method] = [o.token_ids for o in engine.generate(reqs)]
    assert outs["dflash"] == outs["ar"] and outs["ddtree"] == outs["ar"]


def test_engine_refuses_draft_fp8_without_a_drafter(tiny_pair, tiny_tokenizer):
    from ddtree.engine import Engine, EngineConfig

    target, _ = tiny_pair
    with pytest.raises(ConfigError, match="draft_fp8 needs a drafter"):
        Engine.from_models(target, None, tiny_tokenizer, EngineConfig(max_batch=2, max_len=64, draft_fp8=True))
    with pytest.raises(ConfigError, match="draft_fp8 must be true or false"):
        EngineConfig(draft_fp8="yes").validated()


def test_engines_sharing_a_drafter_must_agree_on_fp8(tiny_pair, tiny_tokenizer):
    from ddtree.engine import Engine, EngineConfig

    target, drafter = tiny_pair
    plain, quantised = copy.deepcopy(drafter), copy.deepcopy(drafter)
    config = EngineConfig(max_batch=2, max_len=64)
    Engine.from_models(target, plain, tiny_tokenizer, config)
    with pytest.raises(ConfigError, match="also serves an engine with draft_fp8=False"):
        Engine.from_models(target, plain, tiny_tokenizer, EngineConfig(max_batch=2, max_len=64, draft_fp8=True))
    Engine.from_models(target, quantised, tiny_tokenizer, EngineConfig(max_batch=2, max_len=64, draft_fp8=True))
    with pytest.raises(ConfigError, match="carries fp8 copies"):
        Engine.from_models(target, quantised, tiny_tokenizer, config)
    Engine.from_models(target, quantised, tiny_tokenizer, EngineConfig(max_batch=2, max_len=64, draft_fp8=True))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not fp8.fp8_supported(torch.device("cuda")),
                          reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")


@cuda
def test_the_quantize_kernel_equals_the_eager_quantisation_on_the_gpu():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16) * 7.0
    inv = torch.tensor(448.0 / 20.0, device="cuda")  # some values saturate
    got = fp8.quantize(x, inv, kernel=True)
    want = fp8.quantize(x, inv, kernel=False)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@cuda
def test_a_graphed_gpu_engine_with_an_fp8_drafter_is_lossless(tiny_pair, tiny_tokenizer):
    from ddtree.engine import Engine, EngineConfig

    target, drafter = (copy.deepcopy(m).to("cuda") for m in tiny_pair)
    config = EngineConfig(max_batch=4, max_len=256, max_budget=16, draft_fp8=True, cuda_graphs=True)
    engine = Engine.from_models(target, drafter, tiny_tokenizer, config, model_name="fp8-gpu")
    engine.start()
    try:
        assert all(p.calibrated for p in fp8.projections(drafter))
        _assert_chain_and_tree_equal_ar(engine)
    finally:
        engine.shutdown(drain_timeout=0)
