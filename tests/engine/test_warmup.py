"""The start-up warm-up plan (ddtree.engine.warmup): its size against hand counts, its coverage of every round the
real scheduler builds (a property test over random request mixes), the memory fit, and the state machine on a CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.engine import EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.config import parse_warmup
from ddtree.engine.cuda_graphs import AttentionDims, PrefillKey, graph_key, prefill_key, shared_key
from ddtree.engine.round import RoundShape
from ddtree.engine.warmup import (
    EagerChunk,
    GraphDims,
    Warmup,
    WarmupPlan,
    WarmupStep,
    eager_chunk_variants,
    fit_plan,
    plan_bytes,
    plan_warmup,
    round_bytes,
)
from ddtree.errors import ConfigError


def _plan(cfg: EngineConfig, *, block: int = 16, drafts: bool = True) -> WarmupPlan:
    headroom = max(-(-cfg.prefill_chunk // 16) * 16, cfg.max_budget + 1, block) + 1  # build.build's headroom
    return plan_warmup(cfg, cache_len=cfg.max_len + headroom, drafts=drafts, block_size=block,
                       prefill_max_width=min(1024, cfg.prefill_chunk))


def test_plan_of_the_module_docstring_example():
    # cache_len 117: rows {1, 2, 4}; lengths {64, 117} for AR and for b8 -> 3 x (2 + 2) round keys
    cfg = EngineConfig(max_batch=4, max_len=100, max_budget=8, prefill_chunk=16, prefill_step_tokens=64,
                       default_tree=TreeSettings(budget=8))
    plan = _plan(cfg)
    assert len(plan.rounds) == 12
    assert {(k.rows, k.max_budget, k.kv_len) for k in plan.rounds} == {
        (r, n, length) for r in (1, 2, 4) for n in (0, 8) for length in (64, 117)}
    assert plan.prefills == tuple(PrefillKey(rows=r, width=16) for r in (1, 2, 4))
    # a step of 32 holds two rows of 16 at most, one of 16 alone a step of 16 (the CPU default: prefill_chunk)
    assert _plan(dataclasses.replace(cfg, prefill_step_tokens=32)).prefills == (PrefillKey(1, 16), PrefillKey(2, 16))
    assert _plan(dataclasses.replace(cfg, prefill_step_tokens=None)).prefills == (PrefillKey(1, 16),)
    # no tree-attention dims (a dense engine): one eager chunk, the chunk's width over its length bucket
    assert plan.eager_chunks == (EagerChunk(1, 16, 64),)


def test_plan_sizes_against_hand_counts():
    # max_batch 6 -> rows {1, 2, 4, 6}; cache_len 2000 + 65 = 2065 -> lengths {64, ..., 2048, 2065}: 7 per shape
    cfg = EngineConfig(max_batch=6, max_len=2000, max_budget=8, prefill_chunk=64, prefill_step_tokens=512,
                       default_tree=TreeSettings(budget=8))
    assert len(_plan(cfg).rounds) == 4 * 7 * 2  # fast: AR + the default b8
    # full: AR, the chain (nodes 15), DDTree nodes {1, 2, 3, 4, 7, 8}: 8 shapes x 3 sampling variants
    assert len(_plan(dataclasses.replace(cfg, warmup="full")).rounds) == 4 * 7 * 8 * 3
    # declared budgets 3 and 5 add nodes 3 and 7
    assert len(_plan(dataclasses.replace(cfg, warmup="3,5")).rounds) == 4 * 7 * 4
    assert len(_plan(dataclasses.replace(cfg, warmup="none")).rounds) == 0
    # prefill: up to 8 rows (bucketed) of 64 fit a step of 512, so every rows bucket meets widths 16, 32 and 64;
    # steps of 64: rows 1 at widths 16-64, 2 at 16-32, 3-4 at 16, 5-6 none (8 x 16 > 64)
    assert len(_plan(cfg).prefills) == 4 * 3
    assert len(_plan(dataclasses.replace(cfg, prefill_step_tokens=64)).prefills) == 3 + 2 + 1
    # without a drafter every level is AR only
    assert len(_plan(dataclasses.replace(cfg, warmup="full"), drafts=False).rounds) == 4 * 7 * 3


def test_warmup_values_are_validated_at_the_edge():
    assert parse_warmup("fast") == ("fast", ())
    assert parse_warmup("4, 15,31") == ("fast", (4, 15, 31))
    for bad in ("quick", "", "0", "4,x"):
        with pytest.raises(ConfigError, match="warmup must be"):
            parse_warmup(bad)
    with pytest.raises(ConfigError, match="exceed max_budget"):
        EngineConfig(max_budget=16, warmup="4,32").validated()


def test_fit_plan_drops_the_largest_keys_first():
    dims = GraphDims(vocab=1000, hidden=64, intermediate=128, features=128, elem=2)
    cfg = EngineConfig(max_batch=8, max_len=300, max_budget=16, prefill_chunk=32)
    plan = _plan(cfg)
    full = plan_bytes(plan, dims)
    fitted, dropped = fit_plan(plan, dims, full // 2)
    assert 0 < dropped < plan.graphs and plan_bytes(fitted, dims) <= full // 2
    kept = max(sum(round_bytes(k, dims)) for k in fitted.rounds)
    left_out = set(plan.rounds) - set(fitted.rounds)
    assert left_out and min(sum(round_bytes(k, dims)) for k in left_out) >= kept
    assert fit_plan(plan, dims, full) == (plan, 0)


def test_state_machine_counts_steps_and_drops_a_failing_one(caplog):
    seen = []

    def boom() -> None:
        raise RuntimeError("no room")

    warmup = Warmup(plan=WarmupPlan(level="fast"), steps=[
        WarmupStep("a", lambda: seen.append("a")), WarmupStep("b", boom), WarmupStep("c", lambda: seen.append("c")),
        WarmupStep("eager", lambda: seen.append("eager"), graph=False)])
    assert warmup.state == "pending" and warmup.message() == "loading; warm-up of 3 graphs next"
    warmup.run()
    assert seen == ["a", "c", "eager"]
    assert warmup.state == "done" and warmup.done == 3 and warmup.dropped == 1
    assert "warm-up step b failed" in caplog.text
    info = warmup.info()
    assert info["graphs_planned"] == 3 and info["misses"] == {"round_graphs": 0, "prefill_graphs": 0,
                                                               "mixed_graphs": 0, "triton_compiles": 0}
    warmup.run()  # idempotent
    assert seen == ["a", "c", "eager"]


def test_cpu_engine_runs_the_same_state_machine_with_an_empty_plan(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=2, max_len=64, max_budget=16, warmup="full")
    info = engine.info()["warmup"]
    assert info["state"] == "done" and info["level"] == "full"
    assert info["graphs_planned"] == 0 and info["misses"]["round_graphs"] == 0


# ---- coverage: every round the scheduler builds falls in the plan -----------------------------------------------
MAX_BATCH, MAX_LEN, MAX_BUDGET, CHUNK = 4, 96, 12, 24
_ENGINES: dict[str, object] = {}


def _engine(level: str, tiny_pair, tiny_tokenizer):
    """One CPU engine per level (the tiny pair, block 8), its rounds' shapes and prefill chunks recorded. A level
    ``"fast@96"`` is ``fast`` with prefill steps of 96 tokens (four chunks; the CPU default is one)."""
    if level not in _ENGINES:
        from ddtree.engine import Engine

        target, drafter = tiny_pair
        warmup, _, step = level.partition("@")
        cfg = EngineConfig(max_batch=MAX_BATCH, max_len=MAX_LEN, max_budget=MAX_BUDGET, prefill_chunk=CHUNK,
                           prefill_step_tokens=int(step) if step else None, overlap_rounds=True, warmup=warmup,
                           default_tree=TreeSettings(budget=6))
        engine = Engine.from_models(target, drafter, tiny_tokenizer, cfg, model_name="tiny")
        engine.shapes, engine.prefills = [], []
        queue, prefill = engine._queue, engine.runner.prefill

        def recording_queue(states, rows, shape, patch=None, *, _q=queue, _e=engine, **kw):
            _e.shapes.append(shape)
            return _q(states, rows, shape, patch, **kw)

        def recording_prefill(inp, *, _p=prefill, _e=engine, **kw):
            _e.prefills.append((inp.ids.shape[0], inp.ids.shape[1], inp.kv_len, bool(inp.start.any())))
            return _p(inp, **kw)

        engine._queue = recording_queue
        engine.runner.prefill = recording_prefill
        engine.start()
        _ENGINES[level] = engine
    return _ENGINES[level]


@pytest.fixture(scope="module", autouse=True)
def _shutdown_engines():
    yield
    for engine in _ENGINES.values():
        engine.shutdown(drain_timeout=0)
    _ENGINES.clear()


def _requests(draw, level: str) -> tuple[list[GenerationRequest], int]:
    """A random request mix inside what ``level`` declares (see ddtree.engine.warmup's module docstring)."""
    level = level.partition("@")[0]
    _, budgets = parse_warmup(level)
    n = draw(st.integers(1, 7))
    out = []
    for _ in range(n):
        if level == "full":
            method = draw(st.sampled_from(["ar", "dflash", "ddtree"]))
            budget = draw(st.integers(1, MAX_BUDGET))
            temperature = draw(st.sampled_from([0.0, 0.8]))
            top_p, top_k = draw(st.sampled_from([(1.0, 0), (0.9, 0), (1.0, 5)]))
        else:
            method = draw(st.sampled_from(["ar", "ddtree"]))
            budget = draw(st.sampled_from([6, *budgets]))
            temperature, top_p, top_k = 0.0, 1.0, 0
        prompt = draw(st.integers(1, 70))
        new = draw(st.integers(1, MAX_LEN - prompt))
        out.append(GenerationRequest(
            prompt_token_ids=[5 + (i * 7) % 200 for i in range(prompt)], tree=TreeSettings(method=method, budget=budget),
            sampling=SamplingParams(max_tokens=min(new, 24), temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=1, ignore_eos=True)))
    return out, draw(st.integers(1, n))


def _dims(engine) -> AttentionDims:
    """The tree-attention dims of the CPU engine's models as a CUDA build would take them (H200 SM count): the CPU
    engine attends densely, but its scheduler picks the same shapes, and the launches follow from those."""
    t, d = engine.runner.target.config, engine.runner.drafter.config
    elem = next(engine.runner.target.parameters()).element_size()
    return AttentionDims((t.num_heads, t.num_kv_heads, t.head_dim), (d.num_heads, d.num_kv_heads, d.head_dim), elem,
                         132)


def _plan_of(engine) -> WarmupPlan:
    return plan_warmup(engine.config, cache_len=engine.cache_len, drafts=True, block_size=8,
                       prefill_max_width=min(1024, CHUNK), attention=_dims(engine))


def _check_covered(engine, plan: WarmupPlan) -> None:
    dims = _dims(engine)
    keys = set(plan.rounds)
    for shape in engine.shapes:
        key = shared_key(graph_key(shape, max_rows=MAX_BATCH, cache_len=engine.cache_len), dims, engine.cache_len)
        assert key in keys, f"round {shape} -> key {key} is outside the {plan.level!r} plan"
    prefills = set(plan.prefills)
    for rows, width, kv_len, continued in engine.prefills:
        key = prefill_key(rows, width, MAX_BATCH)
        if not continued and key.width <= CHUNK:
            assert key in prefills, f"prefill chunk {rows}x{width} -> {key} is outside the plan"
        # on the CPU every chunk runs eagerly (no prefill graphs): all of them must launch planned variants
        chunk = EagerChunk(rows, width, kv_len)
        missing = set(eager_chunk_variants(chunk, dims)) - plan.eager_variants
        assert not missing, f"eager prefill chunk {chunk} launches variants outside the plan: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("level", ["fast", "full", "3,9", "fast@96"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_request_mixes_stay_inside_the_plan(level, data, tiny_pair, tiny_tokenizer):
    engine = _engine(level, tiny_pair, tiny_tokenizer)
    plan = _plan_of(engine)
    engine.shapes.clear()
    engine.prefills.clear()
    requests, in_flight = _requests(data.draw, level)
    outputs = engine.generate(requests, max_in_flight=in_flight)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    _check_covered(engine, plan)
    step = engine.config.prefill_step_tokens
    assert all(rows == 1 or (1 << (rows - 1).bit_length()) * width <= step for rows, width, _, _ in engine.prefills)


@pytest.mark.slow
def test_the_coverage_check_can_fail(tiny_pair, tiny_tokenizer):
    """A request outside the declared space (log-probs; a budget the fast plan does not hold) gives a key outside
    the plan, so the property above is not vacuous."""
    engine = _engine("fast", tiny_pair, tiny_tokenizer)
    plan = _plan_of(engine)
    for extra in ({"sampling": SamplingParams(max_tokens=4, logprobs=1)},
                  {"tree": TreeSettings(budget=12), "sampling": SamplingParams(max_tokens=4)}):
        engine.shapes.clear()
        engine.generate([GenerationRequest(prompt_token_ids=[5, 6, 7], **extra)])
        with pytest.raises(AssertionError, match="outside"):
            _check_covered(engine, plan)
    # an eager chunk of a width the scheduler would have padded (17: neither 1 nor a multiple of 16) is outside
    engine.shapes.clear()
    engine.prefills[:] = [(1, 17, 64, True)]
    with pytest.raises(AssertionError, match="variants outside the plan"):
        _check_covered(engine, plan)


def test_round_shape_type_is_the_plan_key():
    # the plan's keys are RoundShapes with both lengths equal (graph_key keys the drafter by the verify's bucket)
    key = graph_key(RoundShape(rows=3, max_budget=5, block_size=8, kv_len=70, draft_kv_len=64, greedy=True,
                               filtered=False, contiguous=False), max_rows=4, cache_len=500)
    assert (key.rows, key.max_budget, key.kv_len, key.draft_kv_len) == (4, 7, 128, 128)


# ---- memory: KV sizing after the plan's graphs, and the cut before capture --------------------------------------
def test_kv_slots_leave_room_for_the_plan_s_graphs(monkeypatch, tiny_pair):
    from ddtree.engine import build

    target, drafter = tiny_pair
    monkeypatch.setattr(build, "_host_available_bytes", lambda: 1 << 30)
    cfg = EngineConfig(max_len=256, kv_memory_fraction=0.5)
    headroom = 100
    tc, dc = target.config, drafter.config
    per_slot = sum(2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 for c in (tc, dc)) * (256 + headroom)  # fp32
    device = next(target.parameters()).device
    assert build._slots_from_memory(target, drafter, cfg, headroom, device) == (1 << 29) // per_slot
    reserved = 10 * per_slot + 1
    assert build._slots_from_memory(target, drafter, cfg, headroom, device, reserved=reserved) == (
        ((1 << 29) - reserved) // per_slot)
    with pytest.raises(ConfigError, match="warm-up's graphs"):
        build._slots_from_memory(target, drafter, cfg, headroom, device, reserved=1 << 29)


def test_run_cuts_the_plan_to_free_memory_largest_first(caplog):
    from ddtree.engine.warmup import KeyStep

    dims = GraphDims(vocab=1000, hidden=64, intermediate=128, features=128, elem=2)
    plan = _plan(EngineConfig(max_batch=8, max_len=300, max_budget=16, prefill_chunk=32))
    captured: list = []
    steps = sorted([KeyStep(label=str(k), run=lambda k=k: captured.append(k), key=k, bytes=sum(round_bytes(k, dims)))
                    for k in plan.rounds], key=lambda s: s.bytes)
    warmup = Warmup(plan=replace_prefills(plan), steps=steps, dims=dims)
    budget = plan_bytes(replace_prefills(plan), dims) // 3
    warmup.run(free_bytes=lambda: budget, reserve_bytes=0)
    assert 0 < len(captured) < len(plan.rounds) and warmup.dropped == len(plan.rounds) - len(captured)
    assert "do not fit" in caplog.text
    assert max(sum(round_bytes(k, dims)) for k in captured) <= min(
        sum(round_bytes(k, dims)) for k in set(plan.rounds) - set(captured))


def replace_prefills(plan: WarmupPlan) -> WarmupPlan:
    return dataclasses.replace(plan, prefills=())


# ---- shared keys and eager chunks: hand-computed launches --------------------------------------------------------
H200_8B = AttentionDims((32, 8, 128), (32, 8, 128), 2, 132)  # Qwen3-8B's heads, bf16, the H200's 132 SMs


def test_length_buckets_that_launch_alike_share_the_longest_key():
    # AR at 32 rows: 32 x 8 row programs want ceil(264 / 256) = 2 splits, and a split needs 4 key blocks of 64:
    # lengths 64-256 have at most 4 blocks -> 1 split; 512 and up -> 2 splits. Tiles are the same at every length
    # below 4096 (one 16-row tile, 64 keys, 2 stages). So {64, 128, 256} share 256's graphs, the rest the cap's.
    cache_len = 3729
    ar = RoundShape(rows=32, max_budget=0, block_size=1, kv_len=64, draft_kv_len=64, greedy=True, filtered=False,
                    contiguous=True)
    rep = {length: shared_key(dataclasses.replace(ar, kv_len=length, draft_kv_len=length), H200_8B, cache_len).kv_len
           for length in (64, 128, 256, 512, 1024, 2048, 3072, 3729)}
    assert rep == {64: 256, 128: 256, 256: 256, 512: 3729, 1024: 3729, 2048: 3729, 3072: 3729, 3729: 3729}
    # one row is latency-bound up to 2048 keys (16-row tiles, splits of 2 blocks) and wants 33 splits: the split
    # count is max(1, blocks // 2) up to 2048 (64: 1 block and 128: 2 blocks -> 1; 256 -> 2; ...; 2048 -> 16)
    one = dataclasses.replace(ar, rows=1)
    assert {n: shared_key(dataclasses.replace(one, kv_len=n, draft_kv_len=n), H200_8B, cache_len).kv_len
            for n in (64, 128, 256, 512, 1024, 2048)} == {64: 128, 128: 128, 256: 256, 512: 512, 1024: 1024,
                                                          2048: 2048}
    # without the kernel (dims None) every key is its own
    assert shared_key(ar, None, cache_len) == ar


def test_eager_chunk_variants_follow_the_width_class_and_the_combine_unroll():
    # T = 16 and T = 32 (both multiples of 16, one visibility word) launch the same split variant at 1 row over
    # 64 keys (direct: one block, one split); T = 17 specialises differently (neither 1 nor divisible by 16)
    v16 = eager_chunk_variants(EagerChunk(1, 16, 64), H200_8B)
    v32 = eager_chunk_variants(EagerChunk(1, 32, 64), H200_8B)
    v17 = eager_chunk_variants(EagerChunk(1, 17, 64), H200_8B)
    assert len(v16) == 1 and v16 == v32 and v17 != v16
    # 1 row of 16 over 1024 keys: 16 blocks / 2 per split -> 8 splits, 9 partials, unrolled as 9; over 512 keys 4
    # splits -> 5 partials; over 384 keys (a length no bucket has) 3 splits -> unrolled as 5 too. The split kernel's
    # variant is the same for all (num_splits is not specialised)
    a = eager_chunk_variants(EagerChunk(1, 16, 1024), H200_8B)
    b = eager_chunk_variants(EagerChunk(1, 16, 512), H200_8B)
    c = eager_chunk_variants(EagerChunk(1, 16, 384), H200_8B)
    assert a[0] == b[0] == c[0] and a[1][1] == 9 and b[1][1] == 5 and c[1] == b[1]


def test_plan_keeps_one_key_per_shared_group_and_plans_every_eager_variant():
    cfg = EngineConfig(max_batch=32, max_len=3216, max_budget=32, prefill_chunk=512, warmup="4,31",
                       default_tree=TreeSettings(budget=15))
    cache_len = 3216 + 513
    dense = plan_warmup(cfg, cache_len=cache_len, drafts=True, block_size=16, prefill_max_width=256)
    plan = plan_warmup(cfg, cache_len=cache_len, drafts=True, block_size=16, prefill_max_width=256,
                       attention=H200_8B)
    assert len(dense.rounds) == 4 * 6 * 8  # AR, b4, b15, b31 x rows {1 .. 32} x 8 length buckets
    assert {shared_key(k, H200_8B, cache_len) for k in dense.rounds} == set(plan.rounds)
    assert len(plan.rounds) < len(dense.rounds)
    covered = set()
    for chunk in plan.eager_chunks:
        covered.update(eager_chunk_variants(chunk, H200_8B))
    assert covered == plan.eager_variants


def test_graph_memory_estimates_by_hand():
    """round_bytes' transient is the verify's peak or the tree stage's drafter logits at the depths the round's trees
    reach (RoundShape.draft_depths, not the whole block), whichever is larger; draft_bytes is the block's states."""
    from ddtree.engine.warmup import draft_bytes

    dims = GraphDims(vocab=1000, hidden=8, intermediate=16, features=24, elem=2)
    key = RoundShape(rows=4, max_budget=3, block_size=16, kv_len=64, draft_kv_len=64, greedy=True, filtered=False,
                     contiguous=False)
    persistent, transient = round_bytes(key, dims)
    verify = 4 * 4 * (4 * 1000 + 2 * (3 * 16 + 6 * 8))  # rows x nodes x (fp32 logits + MLP and norms)
    tree = 4 * 3 * (8 + 2) * 1000  # rows x 3 depths (not 15) x (logits, fp32 copy, temporary)
    assert transient == max(verify, tree) == tree
    assert persistent == 4 * 4 * ((24 + 8) * 2 + 4 // 8 + 64) + (1 << 16)
    assert draft_bytes(key, dims) == 4 * 16 * 8 * 2
    auto = dataclasses.replace(key, auto_width=7)  # the tree stage heads 7 depths for the expected lengths
    assert round_bytes(auto, dims)[1] == 4 * 7 * 10 * 1000
