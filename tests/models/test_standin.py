"""Stand-ins compute their small pair's functions: logits, features, draft logits, greedy outputs, acceptance.

The references are the small models themselves (tested against transformers in test_target / test_drafter). The
scaled-down bodies below exercise every placement rule: an identity layer before the first real one, a feature
read from the small target's last (final-normed) layer, a big fc input block with no small counterpart, GQA groups
narrower than the small ones (small KV heads replicated), biases, untied heads and a hidden ratio that is not a
power of four.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import typer
from model_helpers import random_drafter, random_target, rel_err
from typer.testing import CliRunner

from ddtree.errors import ConfigError
from ddtree.models import DFlashDrafter, TargetModel, load_drafter, load_target, load_tokenizer
from ddtree.models.cli import register
from ddtree.models.config import DrafterConfig, TargetConfig
from ddtree.models.standin import (
    SHAPES,
    StandinShape,
    build_standin,
    load_benchmark_models,
    logit_agreement,
    plan_standin,
    standin_configs,
    standin_shape,
)

# For the conftest tiny pair (hidden 64, 3 layers, 4 / 2 heads of 16; drafter reads layers (0, 2), 4 / 2 heads).
SHAPE = StandinShape(
    name="test", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=384,
    draft_num_layers=4, draft_num_heads=4, draft_num_kv_heads=4, draft_intermediate_size=160, draft_num_inputs=3,
)
# For model_helpers' pair (hidden 32, 4 layers, head_dim 8; drafter reads (0, 2)): hidden ratio 2.5.
ODD_SHAPE = StandinShape(
    name="odd", hidden_size=80, num_layers=9, num_heads=6, num_kv_heads=3, head_dim=8, intermediate_size=64,
    draft_num_layers=3, draft_num_heads=8, draft_num_kv_heads=2, draft_intermediate_size=48, draft_num_inputs=4,
)

# z-lab/Qwen3-8B-DFlash-b16 config.json (the fields that fix the body) and Qwen/Qwen3-8B's.
ZLAB_QWEN3_8B_DFLASH_B16 = dict(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                                head_dim=128, intermediate_size=12288, target_layer_ids=[1, 9, 17, 25, 33],
                                num_target_layers=36)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288)


def _check_pair_matches(small_t, small_d, big_t, big_d, shape: StandinShape, tol: float) -> None:
    """Target logits, every feature the small drafter reads (in its planned fc slot, padding exactly zero) and
    the drafter's logits for several anchored blocks, on random tokens."""
    ids = torch.randint(0, small_t.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    small_out = small_t.forward_train(ids, small_d.config.target_layer_ids)
    big_out = big_t.forward_train(ids, big_d.config.target_layer_ids)
    assert rel_err(big_out.logits, small_out.logits) < tol

    h = small_t.config.hidden_size
    plan = plan_standin(small_t.config, small_d.config, shape)
    small_f = small_out.hidden.unflatten(-1, (len(small_d.config.target_layer_ids), h))  # [B, T, n, h]
    big_f = big_out.hidden.unflatten(-1, (shape.draft_num_inputs, shape.hidden_size))  # [B, T, n', H]
    for j, slot in enumerate(plan.feature_slots):
        assert rel_err(big_f[..., slot, :h], small_f[..., j, :]) < tol, f"small feature {j} is not in slot {slot}"
    assert torch.count_nonzero(big_f[..., h:]) == 0, "padded hidden dims must stay exactly zero"

    anchors = torch.tensor([[0, 6, 11], [3, 9, 12]])
    small_draft = small_d.forward_train(small_t, ids, small_out.hidden, anchors)
    big_draft = big_d.forward_train(big_t, ids, big_out.hidden, anchors)
    assert rel_err(big_draft, small_draft) < tol


def test_tiny_pair_standin_matches_logits_features_and_draft_logits(tiny_pair):
    target, drafter = tiny_pair
    big_t, big_d = build_standin(target, drafter, SHAPE)
    assert big_t.config.hidden_size == 256 and big_t.config.num_layers == 8 and big_d.config.num_layers == 4
    assert big_d.config.target_layer_ids == (1, 3, 7)  # (1, 3, 5) with the last slot moved to the last layer
    _check_pair_matches(target, drafter, big_t, big_d, SHAPE, tol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_families_with_biases_untied_heads_and_an_odd_hidden_ratio_match(family):
    """A large eps (0.5) makes any slip in the RMSNorm / q_norm / k_norm compensation visible far above rounding."""
    bias = family != "qwen3"
    target = random_target(family=family, attention_bias=bias, qk_norm=family == "qwen3", rms_norm_eps=0.5)
    drafter = random_drafter(attention_bias=bias, rms_norm_eps=0.5)
    big_t, big_d = build_standin(target, drafter, ODD_SHAPE, seed=3)
    assert big_t.lm_head is not None
    _check_pair_matches(target, drafter, big_t, big_d, ODD_SHAPE, tol=1e-5)


def test_values_that_cannot_reach_the_output_do_not(tiny_pair):
    """Two seeds give different random parts and bit-identical outputs: nothing random leaks."""
    target, drafter = tiny_pair
    a_t, a_d = build_standin(target, drafter, SHAPE, seed=0)
    b_t, b_d = build_standin(target, drafter, SHAPE, seed=1)
    assert not torch.equal(a_t.layers[0].self_attn.q_proj.weight, b_t.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(a_d.fc.weight, b_d.fc.weight)
    ids = torch.randint(0, target.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    a_out = a_t.forward_train(ids, a_d.config.target_layer_ids)
    b_out = b_t.forward_train(ids, b_d.config.target_layer_ids)
    assert torch.equal(a_out.logits, b_out.logits)
    anchors = torch.tensor([[2, 8], [5, 10]])
    assert torch.equal(a_d.forward_train(a_t, ids, a_out.hidden, anchors),
                       b_d.forward_train(b_t, ids, b_out.hidden, anchors))


def test_bf16_standin_keeps_padding_exact_and_agrees_to_rounding(tiny_pair):
    """bf16 is not bit-identical to the fp32 small pair (documented), but padding stays exactly zero, nothing
    overflows and greedy choices agree almost everywhere."""
    target, drafter = tiny_pair
    big_t, big_d = build_standin(target, drafter, SHAPE, dtype=torch.bfloat16)
    assert big_t.dtype == torch.bfloat16 and big_d.dtype == torch.bfloat16
    ids = torch.randint(0, target.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    out = big_t.forward_train(ids, big_d.config.target_layer_ids)
    assert torch.isfinite(out.logits).all()
    assert torch.count_nonzero(out.hidden.unflatten(-1, (3, 256))[..., 64:]) == 0
    agreement = logit_agreement(target, big_t, ids)
    assert agreement["max_rel_logit_diff"] < 5e-2
    assert agreement["argmax_agreement"] >= 0.95


def _demo_like_configs(feature_ids: tuple[int, ...]) -> tuple[TargetConfig, DrafterConfig]:
    target = TargetConfig(family="qwen3", vocab_size=8192, hidden_size=256, num_layers=8, num_heads=2,
                          num_kv_heads=1, head_dim=128, intermediate_size=768, tie_word_embeddings=True, qk_norm=True)
    drafter = DrafterConfig(hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                            intermediate_size=768, vocab_size=8192, block_size=16, mask_token_id=3,
                            target_layer_ids=feature_ids)
    return target, drafter


def test_qwen3_8b_preset_is_the_published_bodies():
    s = standin_shape("qwen3-8b")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size) == (
        QWEN3_8B["hidden_size"], QWEN3_8B["num_hidden_layers"], QWEN3_8B["num_attention_heads"],
        QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"], QWEN3_8B["intermediate_size"])
    z = ZLAB_QWEN3_8B_DFLASH_B16
    target, drafter = _demo_like_configs((1, 5))
    plan = plan_standin(target, drafter, s)
    big_t, big_d = standin_configs(target, drafter, s, plan)
    body = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size")
    assert {k: big_d.to_hf_dict()[k] for k in body} == {k: z[k] for k in body}
    assert list(big_d.target_layer_ids) == z["target_layer_ids"] and big_d.num_target_layers == z["num_target_layers"]
    # 256 -> 4096: the RMSNorm compensation is an exact factor of 4, i.e. eps / 16
    assert big_t.rms_norm_eps == target.rms_norm_eps / 16 and big_d.rms_norm_eps == drafter.rms_norm_eps / 16
    assert big_t.vocab_size == 8192 and big_t.tie_word_embeddings


def test_qwen3_8b_dry_run_has_the_published_parameter_counts():
    """On the meta device (no memory): Qwen3-8B has 6.95B non-embedding parameters (model card), z-lab's
    Qwen3-8B-DFlash-b16 is a 2.1 GB bf16 safetensors file (about 1.05B parameters)."""
    target_config, drafter_config = _demo_like_configs((1, 2, 3, 4, 5))
    with torch.device("meta"):
        target, drafter = TargetModel(target_config), DFlashDrafter(drafter_config)
    big_t, big_d = build_standin(target, drafter, SHAPES["qwen3-8b"], device="meta", dtype=torch.bfloat16)
    body = sum(p.numel() for p in big_t.parameters()) - big_t.embed_tokens.weight.numel()
    assert abs(body - 6.95e9) < 0.005e9
    assert 2.05e9 < 2 * sum(p.numel() for p in big_d.parameters()) < 2.15e9
    assert big_t.dtype == torch.bfloat16 and big_t.device.type == "meta"


@pytest.mark.parametrize("feature_ids,placement,slots", [
    ((1, 5), (0, 1, 2, 3, 4, 33, 34, 35), (0, 4)),
    ((1, 2, 3, 4, 5), (0, 1, 9, 17, 25, 33, 34, 35), (0, 1, 2, 3, 4)),  # z-lab default ids for 8 layers, 5 inputs
    ((5, 1), (0, 1, 2, 3, 4, 33, 34, 35), (4, 0)),  # the fc block order follows the small drafter's
])
def test_demo_pair_lands_on_the_z_lab_ids(feature_ids, placement, slots):
    target, drafter = _demo_like_configs(feature_ids)
    plan = plan_standin(target, drafter, SHAPES["qwen3-8b"])
    assert plan.feature_ids == (1, 9, 17, 25, 33)
    assert plan.target_layers == placement
    assert plan.feature_slots == slots
    assert plan.drafter_layers == (0, 4)


@pytest.mark.parametrize("change,message", [
    (dict(head_dim=32), "head_dim"),
    (dict(hidden_size=32), "hidden_size"),
    (dict(num_heads=2, num_kv_heads=1), "KV heads"),
    (dict(draft_num_heads=2, draft_num_kv_heads=1), "KV heads"),
    (dict(num_layers=2), "target layers"),
    (dict(num_layers=3), "do not fit"),
    (dict(draft_num_layers=1), "drafter layers"),
    (dict(draft_num_inputs=1), "drafter inputs"),
    (dict(intermediate_size=100), "intermediate_size"),
    (dict(num_heads=6, num_kv_heads=4), "multiple"),
])
def test_shapes_that_cannot_hold_the_pair_are_refused(tiny_pair, change, message):
    target, drafter = tiny_pair
    with pytest.raises(ConfigError, match=message):
        build_standin(target, drafter, dataclasses.replace(SHAPE, **change))


def test_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match="qwen3-8b"):
        standin_shape("qwen3-80b")


# ---- end to end: the engine, with a drafter that accepts -----------------------------------------------------------

def _greedy_data(target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompts
    for _ in range(n):
        ids = torch.cat([ids, target.forward_train(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.fixture(scope="module")
def accepting_pair(tiny_pair):
    """A copy of the tiny pair with softer embeddings (greedy text that changes token now and then) and its
    drafter fitted for a few steps on the target's greedy continuations, so rounds accept 1..block_size tokens."""
    target, drafter = copy.deepcopy(tiny_pair)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        target.embed_tokens.weight.mul_(0.5)
        prompts = torch.randint(2, target.config.vocab_size, (16, 8), generator=gen)
        ids = _greedy_data(target, prompts, 40)
        features = target.forward_train(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    depth = torch.arange(1, drafter.block_size)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    with torch.enable_grad():
        for _ in range(30):
            anchors = torch.randint(4, ids.shape[1] - drafter.block_size, (16, 6), generator=gen)
            logits = drafter.forward_train(target, ids, features, anchors)  # [B, A, bs - 1, V]
            labels = torch.gather(ids, 1, (anchors[..., None] + depth).flatten(1)).view(logits.shape[:-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return target.eval(), drafter.eval(), [p.tolist() for p in prompts[:4]]


def _run(engine_models, tokenizer, prompts, tree):
    from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    target, drafter = engine_models
    engine = Engine.from_models(target, drafter, tokenizer, EngineConfig(max_batch=8, max_len=128, max_budget=16))
    engine.start()
    try:
        requests = [GenerationRequest(prompt_token_ids=p, tree=t, sampling=SamplingParams(max_tokens=32,
                                                                                         ignore_eos=True))
                    for t in tree for p in prompts]
        return engine.generate(requests)
    finally:
        engine.shutdown(drain_timeout=0)


@pytest.mark.slow
def test_engine_greedy_outputs_and_acceptance_are_the_small_pairs(accepting_pair, tiny_tokenizer):
    from ddtree.engine import TreeSettings

    target, drafter, prompts = accepting_pair
    prompts = prompts + [tiny_tokenizer.encode("def fibonacci(n):\n    ")]
    trees = [TreeSettings(method="ar"), TreeSettings(method="dflash"), TreeSettings(method="ddtree", budget=16),
             TreeSettings(method="ddtree", budget=8, topk=2, block_size=5)]
    small = _run((target, drafter), tiny_tokenizer, prompts, trees)
    big = _run(build_standin(target, drafter, SHAPE), tiny_tokenizer, prompts, trees)
    for s, b in zip(small, big, strict=True):
        assert s.finish_reason == b.finish_reason == "length"
        assert b.token_ids == s.token_ids
        assert (b.stats.verify_rounds, b.stats.accept_hist) == (s.stats.verify_rounds, s.stats.accept_hist)
    # guard: the comparison covered real speculation (multi-token rounds), not only one-token rounds
    spec = small[len(prompts):]
    assert max(len(o.stats.accept_hist) for o in spec) >= 4
    assert any(0 < sum(o.stats.accept_hist[2:-1]) for o in spec), "no round accepted part of a draft"
    assert sum(o.stats.completion_tokens for o in spec) > 1.5 * sum(o.stats.verify_rounds for o in spec)


# ---- the command -------------------------------------------------------------------------------------------------

@pytest.fixture
def cli_app(monkeypatch):
    monkeypatch.setitem(SHAPES, "test", SHAPE)
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """Test app."""

    register(app)
    return app


def test_cli_writes_a_loadable_pair_with_the_tokenizer(cli_app, tiny_model_dirs, tiny_pair, tmp_path):
    target_dir, drafter_dir = tiny_model_dirs
    out = tmp_path / "standin"
    result = CliRunner().invoke(cli_app, ["standin", "--shape", "test", "--out", str(out), "--target",
                                          str(target_dir), "--draft", str(drafter_dir), "--device", "cpu",
                                          "--dtype", "float32"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "argmax agreement 1.0000" in result.output
    big_t, big_d = load_target(out / "target"), load_drafter(out / "drafter")
    assert load_tokenizer(out / "target").encode("def f(x):") == load_tokenizer(target_dir).encode("def f(x):")
    target, drafter = tiny_pair
    _check_pair_matches(target, drafter, big_t, big_d, SHAPE, tol=1e-5)
    record = json.loads((out / "standin.json").read_text())
    assert record["shape"]["hidden_size"] == 256 and record["plan"]["feature_ids"] == [1, 3, 7]
    assert record["agreement_on_random_tokens"]["vs_small_float32"]["argmax_agreement"] == 1.0


def test_cli_refuses_half_a_pair_and_the_package_directory(cli_app, tiny_model_dirs, tmp_path):
    import ddtree

    target_dir, _ = tiny_model_dirs
    half = CliRunner().invoke(cli_app, ["standin", "--shape", "test", "--out", str(tmp_path / "x"), "--target",
                                        str(target_dir), "--device", "cpu"])
    assert isinstance(half.exception, ConfigError) and "both" in str(half.exception)
    inside = CliRunner().invoke(cli_app, ["standin", "--shape", "test", "--out",
                                          str(Path(ddtree.__file__).parent / "assets" / "standin"), "--device", "cpu"])
    assert isinstance(inside.exception, ConfigError) and "never shipped" in str(inside.exception)


def test_benchmark_models_are_the_demo_pair_in_the_devices_dtype():
    """What the GPU benchmark scripts load (``load_benchmark_models``): on a CPU the demo pair as shipped, in fp32,
    with its own tokenizer; the same weights ``load_target`` gives."""
    from ddtree.assets import demo_target_path

    target, drafter, tokenizer, dtype = load_benchmark_models("none", torch.device("cpu"))
    assert dtype is torch.float32
    assert next(target.parameters()).dtype is torch.float32 and next(drafter.parameters()).dtype is torch.float32
    shipped = load_target(demo_target_path(), dtype=torch.float32, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), shipped.state_dict().values(),
                                                 strict=True))
    assert tokenizer.encode("def f(x):") == load_tokenizer(demo_target_path()).encode("def f(x):")
