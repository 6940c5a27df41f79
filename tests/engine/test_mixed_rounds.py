"""Mixed rounds (EngineConfig.mixed_chunk): newcomers' prompt chunks ride in the decode round's verify forward.

References: the plain full-recompute decoder (greedy, fp32), the same engine with mixing off (seeded sampling),
and a spy on the runner that records every target forward: what it carried and whether anyone was decoding.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import emulate_graphs, plain_greedy, submit_staggered

from ddtree.engine import EngineConfig, GenerationRequest, SamplingParams, TreeSettings, prefill_steps
from ddtree.engine.runner import ModelRunner
from ddtree.errors import ConfigError

# prompts of different lengths: the long one takes several chunks of 16 tokens
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, mode='r', *, strict=True):\n        ",
    "x",
    "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n",
]
TREES = [TreeSettings(method="ddtree", budget=6), TreeSettings(method="dflash"), TreeSettings(method="ar"),
         TreeSettings(method="ddtree", budget=12, topk=3)]
N = 24


@pytest.fixture(scope="module")
def references(tiny_pair, tiny_tokenizer):
    return {p: plain_greedy(tiny_pair[0], tiny_tokenizer.encode(p), N) for p in PROMPTS}


class _Spy:
    """Every target forward the runner runs: ("round", rows, prompt tokens it carried) or ("prefill", rows, tokens),
    and whether some request was decoding at that moment."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int, int, bool]] = []
        self.ride_takes: list[list[int]] = []  # each mixed round's prompt tokens per rider row
        self.engine = None
        real_round, real_prefill = ModelRunner.round, ModelRunner.prefill
        spy = self

        def round_(runner, inp, timer, work=None):
            carried = 0 if inp.prefill is None else int(inp.prefill.valid_len.sum())
            spy.calls.append(("round", inp.shape.rows, carried, True))
            if carried:
                spy.ride_takes.append(inp.prefill.valid_len.tolist())
            return real_round(runner, inp, timer, work)

        def prefill(runner, inp, **kw):
            spy.calls.append(("prefill", inp.ids.shape[0], int(inp.valid_len.sum()), spy._decoding()))
            return real_prefill(runner, inp, **kw)

        monkeypatch.setattr(ModelRunner, "round", round_)
        monkeypatch.setattr(ModelRunner, "prefill", prefill)

    def _decoding(self) -> bool:
        from ddtree.engine.request_state import Phase

        engine = self.engine  # None during the engine's start-up warm-up
        return engine is not None and any(s.phase is Phase.DECODE for s in engine._active.values())


@pytest.fixture
def queued_rides(monkeypatch) -> list[tuple[int, bool]]:
    """(riders offered, whether the queued round carried them) of every round queued before the one in flight was
    read (Scheduler._follow_up); None rounds (refused) carry nothing."""
    from ddtree.engine.engine import Engine

    seen: list[tuple[int, bool]] = []
    real = Engine._follow_up

    def follow_up(self, flight, size, best=None, joiners=(), riders=()):
        out = real(self, flight, size, best, joiners, riders)
        seen.append((len(riders), out is not None and bool(out.riders)))
        return out

    monkeypatch.setattr(Engine, "_follow_up", follow_up)
    return seen


def _staggered(engine, requests, gap: float = 0.03) -> list[list[int]]:
    """Submit ``requests`` one by one, ``gap`` seconds apart (each arrives while the earlier ones decode)."""
    return submit_staggered(engine, requests, gap)


def _greedy(prompts, trees):
    return [GenerationRequest(prompt=p, tree=t, sampling=SamplingParams(max_tokens=N, ignore_eos=True))
            for p, t in zip(prompts, trees, strict=True)]


def test_mixed_rounds_give_the_plain_decoders_tokens_within_the_chunk_bound(tiny_engine_factory, references,
                                                                            monkeypatch):
    """Staggered arrivals with mixed rounds of 16 prompt tokens: every output equals the plain decoder's; while a
    request decodes no prompt is prefilled by a step of its own, and no round carries more than 16 prompt tokens;
    prompts longer than one chunk ride in several rounds, and prompts really ride (the guard)."""
    spy = _Spy(monkeypatch)
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=16)
    spy.engine = engine
    prompts, trees = PROMPTS * 2, TREES * 2
    outs = _staggered(engine, _greedy(prompts, trees))
    for out, p in zip(outs, prompts, strict=True):
        assert out == references[p]
    rides = [c for c in spy.calls if c[0] == "round" and c[2]]
    assert len(rides) >= len(prompts) - 1, spy.calls  # all but the first request's prompt rode (at least once each)
    assert max(c[2] for c in rides) <= 16
    assert not [c for c in spy.calls if c[0] == "prefill" and c[3]], "a prefill step ran while requests decoded"
    long = len(engine.tokenizer.encode(PROMPTS[1]))
    assert long > 2 * 16 and sum(c[2] for c in rides) >= long  # the long prompt took several rides
    snap = engine.snapshot()
    assert snap.mixed_rounds_total == len(rides)
    assert snap.mixed_prompt_tokens_total == sum(c[2] for c in rides)


def test_riders_follow_a_prefill_steps_rule_with_mixed_chunk_as_its_size(tiny_engine_factory, references,
                                                                          monkeypatch):
    """With chunks of 16 and mixed rounds of 64: no rider's row takes more than 16 prompt tokens (the cache keeps
    only a chunk's headroom, whatever mixed_chunk is), the riders' rows padded to powers of two fit 64
    (prefill_budget.step_fits), rounds really carry several riders, and outputs equal the plain decoder's."""
    from ddtree.engine.prefill_budget import step_fits

    spy = _Spy(monkeypatch)
    engine = tiny_engine_factory(oracle=True, max_batch=8, prefill_chunk=16, mixed_chunk=64)
    spy.engine = engine
    assert engine.cache_len - engine.config.max_len < 64  # the headroom of chunks of 16 and trees of 32, not of 64
    prompts, trees = PROMPTS * 2, TREES * 2
    outs = _staggered(engine, _greedy(prompts, trees), gap=0.01)
    for out, p in zip(outs, prompts, strict=True):
        assert out == references[p]
    assert spy.ride_takes
    for takes in spy.ride_takes:
        assert max(takes) <= 16 and step_fits(len(takes), max(takes), chunk=16, step_tokens=64), takes
    assert max(len(t) for t in spy.ride_takes) > 1, spy.ride_takes


def test_rounds_queued_before_the_flight_is_read_carry_riders(tiny_engine_factory, references, queued_rides):
    """With rounds overlapped, a round queued from the device (a follow-up) takes the arriving prompts' chunks as a
    host launch does (their first tokens read once that round is read, their rows joining the round after with
    the tokens patched on the device): outputs still equal the plain decoder's, and follow-ups really carried
    riders (before, any rider sent the next round to a host launch)."""
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=16)
    assert engine.config.overlap_rounds
    prompts = PROMPTS * 2
    outs = _staggered(engine, _greedy(prompts, [TreeSettings(method="ddtree", budget=6)] * len(prompts)))
    for out, p in zip(outs, prompts, strict=True):
        assert out == references[p]
    assert any(carried for _, carried in queued_rides), queued_rides
    assert all(carried for offered, carried in queued_rides if offered), queued_rides  # none refused for riders


def test_a_riders_prefill_time_is_the_rounds_it_rode_in(tiny_engine_factory, references, monkeypatch):
    """A request whose prompt only rode in mixed rounds has, as its prefill stage time, the stage time of those
    rounds, counted once (its first token's read, one round later, adds nothing: it once added the time since the
    round was queued on top)."""
    from ddtree.engine.engine import Engine

    rode: dict[int, list] = {}  # id(state) -> [state, seconds of the rounds it rode in]
    stepped: set[int] = set()  # states that took a prefill step
    real_collect, real_step = Engine._collect, Engine._prefill_step

    def collect(self, flight):
        timer_collect = flight.timer.collect

        def timed():
            stages = timer_collect()
            for state in flight.riders:
                rode.setdefault(id(state), [state, 0.0])[1] += sum(stages.values())
            return stages

        flight.timer.collect = timed
        return real_collect(self, flight)

    def step(self, states):
        stepped.update(id(s) for s in states)
        return real_step(self, states)

    monkeypatch.setattr(Engine, "_collect", collect)
    monkeypatch.setattr(Engine, "_prefill_step", step)
    engine = tiny_engine_factory(oracle=True, max_batch=5, mixed_chunk=16)
    # an anchor decodes one token a round for much longer than the arrivals take, so every later prompt arrives while
    # a request decodes and rides (without it, on a loaded machine, every prompt could arrive to an idle batch)
    anchor_tokens: list[int] = []
    anchor_first, anchor_done = threading.Event(), threading.Event()

    def on_anchor(chunk):
        anchor_tokens.extend(chunk.token_ids)
        if anchor_tokens:
            anchor_first.set()
        if chunk.finished:
            anchor_done.set()

    anchor = GenerationRequest(prompt=PROMPTS[0], tree=TreeSettings(method="ar"),
                               sampling=SamplingParams(max_tokens=12 * N, ignore_eos=True))
    engine.submit(anchor, on_anchor)
    assert anchor_first.wait(60)
    prompts = PROMPTS * 2
    outs = _staggered(engine, _greedy(prompts, [TreeSettings(method="ddtree", budget=6)] * len(prompts)))
    assert outs == [references[p] for p in prompts]
    assert anchor_done.wait(120) and anchor_tokens[:N] == references[PROMPTS[0]]
    riders = [(state, secs) for key, (state, secs) in rode.items() if key not in stepped]
    assert riders, (len(rode), len(stepped))
    for state, secs in riders:
        assert state.stats.stage_s["prefill"] == pytest.approx(secs, rel=1e-9, abs=1e-12)


def test_mixing_off_prefills_in_steps_of_their_own(tiny_engine_factory, references, monkeypatch):
    spy = _Spy(monkeypatch)
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=0)
    spy.engine = engine
    outs = _staggered(engine, _greedy(PROMPTS, TREES))
    assert outs == [references[p] for p in PROMPTS]
    assert not [c for c in spy.calls if c[0] == "round" and c[2]]
    assert [c for c in spy.calls if c[0] == "prefill" and c[3]]  # the guard: steps did run beside decoding rows


def test_sampled_outputs_are_the_same_with_and_without_mixing(tiny_engine_factory):
    """Seeded sampling: a request's tokens depend on its seed and step only, not on how its prompt was written."""
    reqs = [GenerationRequest(prompt=p, tree=t, sampling=SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9,
                                                                        seed=11 + i, ignore_eos=True))
            for i, (p, t) in enumerate(zip(PROMPTS, TREES, strict=True))]
    mixed = _staggered(tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=16), reqs)
    steps = _staggered(tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=0), reqs)
    assert mixed == steps


def test_a_failing_mixed_round_loses_no_request(tiny_engine_factory, references, monkeypatch):
    """A mixed round that raises at launch: the decoding rows rerun alone and the riders prefill in a step of
    their own; every request still ends with the plain decoder's tokens."""
    real_round = ModelRunner.round
    failed = []

    def round_(runner, inp, timer, work=None):
        if inp.prefill is not None and not failed:
            failed.append(True)
            raise RuntimeError("injected fault in a mixed round")
        return real_round(runner, inp, timer, work)

    monkeypatch.setattr(ModelRunner, "round", round_)
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=16)
    outs = _staggered(engine, _greedy(PROMPTS, TREES))
    assert failed
    assert outs == [references[p] for p in PROMPTS]


def test_requests_that_ask_for_logprobs_prefill_in_steps_and_still_match(tiny_engine_factory, references,
                                                                        monkeypatch):
    spy = _Spy(monkeypatch)
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=16)
    spy.engine = engine
    reqs = _greedy(PROMPTS, TREES)
    reqs[2] = GenerationRequest(prompt=PROMPTS[2], tree=TREES[2],
                                sampling=SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2))
    outs = submit_staggered(engine, reqs, lambda i: _until_decoding(spy))  # each arrives while one decodes
    assert outs == [references[p] for p in PROMPTS]
    assert [c for c in spy.calls if c[0] == "prefill" and c[3]], spy.calls  # its prompt took a step of its own


def _until_decoding(spy: _Spy, timeout: float = 10.0) -> float:
    """Wait until some request of the spied engine decodes (the next one then arrives beside it); sleep no more."""
    end = time.monotonic() + timeout
    while not spy._decoding() and time.monotonic() < end:
        time.sleep(0.001)
    return 0.0


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_mixed_chunk_is_refused(value):
    with pytest.raises(ConfigError, match="mixed_chunk"):
        EngineConfig(mixed_chunk=value).validated()


@pytest.mark.gpu
def test_gpu_exact_mixed_rounds_give_ar_bits():
    """On CUDA in bf16 exact mode (Triton kernels, graphed rounds and graphed mixed rounds): with staggered arrivals
    every request's prompt but the first rides in decode rounds, and every output equals AR alone bit for bit."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.engine import Engine
    from ddtree.models import load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.bfloat16, device="cuda")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.bfloat16, device="cuda")
    config = EngineConfig(device="cuda", dtype="bfloat16", max_batch=8, max_len=1024, max_budget=16, exact=True,
                          mixed_chunk=64, warmup="none")
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name="demo")
    engine.start()
    try:
        long = "def fib(n):\n    " + "a, b = b, a + b\n    " * 30
        prompts = [PROMPTS[0], long, PROMPTS[1], PROMPTS[3], long + "# end\n", PROMPTS[0] * 3]
        def req(p, tree):
            return GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=48, ignore_eos=True))
        ar = {p: engine.generate([req(p, TreeSettings(method="ar"))])[0].token_ids for p in prompts}
        trees = [TreeSettings(method="ddtree", budget=b) for b in (4, 8, 16)] + [TreeSettings(method="dflash")]
        reqs = [req(p, trees[i % len(trees)]) for i, p in enumerate(prompts)]
        outs = _staggered(engine, reqs, gap=0.02)
        assert engine.snapshot().mixed_rounds_total > 0
        # the graphed path (RoundGraphs.run_mixed) ran: chunk layers graphs were captured
        assert sum(len(c.mixed) for c in engine.graphs.graphs.values()) > 0
    finally:
        engine.shutdown()
    for r, out in zip(reqs, outs, strict=True):
        assert out == ar[r.prompt], f"{r.tree} differs from AR on {r.prompt[:30]!r}"



def _emulated_graphs(tiny_engine_factory, monkeypatch, mixed_chunk: int):
    """An engine whose rounds replay graphs emulated on the CPU (engine_helpers.emulate_graphs)."""
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=mixed_chunk)
    emulate_graphs(engine, monkeypatch, max_rows=4, max_chunk_width=16)
    return engine


@pytest.mark.parametrize("mixed_chunk", [16, 0])
def test_graphed_mixed_rounds_give_the_plain_decoders_tokens(mixed_chunk, tiny_engine_factory, references,
                                                             monkeypatch, queued_rides):
    """The graphed path of mixed rounds (RoundGraphs.run_mixed: the chunk's layers graph per round key and chunk
    bucket in place of the shared layers graph) with replays emulated on the CPU (engine_helpers.EmulatedReplays): a value the
    capture fixed (the chunk's last token), an output not written where the key's choice graph reads it, or a
    wrong copy of the first tokens' states changes tokens. Several chunk keys must really be captured, and rounds
    queued from the device must carry chunks too."""
    monkeypatch.setattr(prefill_steps, "MIXED_CAPTURE_SHARE", 1e9)  # every capture at once (the budget's test below)
    engine = _emulated_graphs(tiny_engine_factory, monkeypatch, mixed_chunk)
    prompts, trees = PROMPTS * 2, TREES * 2
    outs = _staggered(engine, _greedy(prompts, trees))
    for out, p in zip(outs, prompts, strict=True):
        assert out == references[p]
    chunk_keys = sum(len(c.mixed) for c in engine.graphs.graphs.values())
    assert chunk_keys >= 2 if mixed_chunk else chunk_keys == 0
    assert engine.graphs.mixed_captures == chunk_keys  # none dropped (max_mixed), each counted once
    assert any(carried for _, carried in queued_rides) == bool(mixed_chunk), queued_rides


def test_mixed_graph_captures_past_their_share_send_riders_to_prefill_steps(tiny_engine_factory, references,
                                                                             monkeypatch):
    """With no time for captures (``MIXED_CAPTURE_SHARE`` 0: only the first, when none has cost anything yet), a
    round whose riders' layers graph is not captured leaves them out, and they take a prefill step in the same
    iteration: exactly one chunk key is captured, rounds were deferred, prompts still rode where that graph serves,
    and every output equals the plain decoder's (a refused rider that nobody prefilled would hang, one prefilled
    twice or not at all would change tokens)."""
    monkeypatch.setattr(prefill_steps, "MIXED_CAPTURE_SHARE", 0.0)
    engine = _emulated_graphs(tiny_engine_factory, monkeypatch, 16)
    prompts, trees = PROMPTS * 3, TREES * 3
    outs = _staggered(engine, _greedy(prompts, trees))
    for out, p in zip(outs, prompts, strict=True):
        assert out == references[p]
    snap = engine.snapshot()
    assert engine.graphs.mixed_captures == 1 == sum(len(c.mixed) for c in engine.graphs.graphs.values())
    assert snap.mixed_deferred_total > 0
    assert snap.mixed_rounds_total > 0
