"""Request handling: bad input fails alone before taking a slot, faults stay confined, cancel frees the slot,
stop rules, streaming and statistics."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings
from ddtree.errors import InvalidRequestError


def _req(prompt="def f(x):\n", tree=None, **sampling):
    sampling.setdefault("max_tokens", 16)
    return GenerationRequest(prompt=prompt, tree=tree, sampling=SamplingParams(**sampling))


@pytest.mark.parametrize(
    "request_kwargs,param",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="x" * 10, max_tokens=10_000), "max_tokens"),
        (dict(tree=TreeSettings(method="ddtree", budget=0)), "budget"),
        (dict(tree=TreeSettings(method="ddtree", budget=10_000)), "budget"),
        (dict(tree=TreeSettings(method="ddtree", topk=0)), "topk"),
        (dict(tree=TreeSettings(method="ddtree", block_size=1)), "block_size"),
        (dict(tree=TreeSettings(method="ddtree", block_size=64)), "block_size"),
        (dict(tree=TreeSettings(method="ddtree", draft_window=4)), "draft_window"),
        (dict(tree=TreeSettings(method="beam")), "method"),  # type: ignore[arg-type]
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_fail_alone_before_taking_a_slot(tiny_engine_factory, request_kwargs, param):
    engine = tiny_engine_factory()
    tree = request_kwargs.pop("tree", None)
    prompt = request_kwargs.pop("prompt", "def f(x):\n")
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(_req(prompt, tree, **request_kwargs), lambda ch: None)
    assert err.value.param == param
    assert str(err.value)
    snap = engine.snapshot()
    assert snap.running == 0 and snap.queued == 0
    # the engine still serves the next valid request
    (out,) = engine.generate([_req()])
    assert out.finish_reason in ("length", "stop") and out.token_ids


def test_prompt_token_ids_out_of_vocab_rejected(tiny_engine_factory):
    engine = tiny_engine_factory()
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.submit(GenerationRequest(prompt_token_ids=[1, 10**9]), lambda ch: None)


def test_ar_only_engine_rejects_speculative_methods(tiny_engine_factory):
    engine = tiny_engine_factory(drafter=False)
    assert engine.defaults.method == "ar"
    with pytest.raises(InvalidRequestError, match="drafter"):
        engine.validate(_req(tree=TreeSettings(method="ddtree")))
    (out,) = engine.generate([_req(ignore_eos=True)])
    assert len(out.token_ids) == 16


def _poisonable(engine, tokenizer, monkeypatch) -> tuple[list[int], list[GenerationRequest]]:
    """Three requests with disjoint prompt lengths (10, 60, 110 tokens, 24 new each) and a list ``[lo, hi)`` that,
    once filled, makes every round holding a root position in that range raise: a fault in one request, whatever
    slot it lands in. Fill it with [60, 84) to poison the second request."""
    real_round = engine.runner.round
    poisoned: list[int] = []

    def faulty_round(inp, timer, work=None):
        if poisoned and any(poisoned[0] <= p < poisoned[1] for p in inp.start.tolist()):
            raise RuntimeError("injected fault")
        return real_round(inp, timer, work)

    monkeypatch.setattr(engine.runner, "round", faulty_round)
    text = tokenizer.encode("def g(x):\n    return x + 1\n" * 40)
    reqs = [GenerationRequest(prompt_token_ids=text[:n], tree=TreeSettings(method="ddtree", budget=8),
                              sampling=SamplingParams(max_tokens=24, ignore_eos=True)) for n in (10, 60, 110)]
    return poisoned, reqs


def test_a_fault_in_one_request_leaves_the_others_running(tiny_engine_factory, tiny_tokenizer, monkeypatch):
    """A round that fails for one request is isolated: that request errors, the others produce their usual
    tokens."""
    engine = tiny_engine_factory(oracle=True)
    poisoned, reqs = _poisonable(engine, tiny_tokenizer, monkeypatch)
    alone = [engine.generate([r])[0].token_ids for r in reqs]

    poisoned.extend([60, 60 + 24])  # the second request's root positions
    outs = engine.generate(reqs)
    assert outs[1].finish_reason == "error" and "injected fault" in outs[1].error
    assert outs[0].token_ids == alone[0] and outs[2].token_ids == alone[2]
    poisoned.clear()
    assert engine.generate([reqs[1]])[0].token_ids == alone[1]


def test_a_consumer_that_raises_only_cancels_its_own_request(tiny_engine_factory):
    engine = tiny_engine_factory()
    done = threading.Event()
    good = []

    def bad(chunk):
        raise ValueError("consumer bug")

    def ok(chunk):
        good.extend(chunk.token_ids)
        if chunk.finished:
            done.set()

    engine.submit(_req(max_tokens=30, ignore_eos=True), bad)
    engine.submit(_req(max_tokens=30, ignore_eos=True), ok)
    assert done.wait(30)
    assert len(good) == 30
    assert engine.snapshot().requests_total.get("cancelled", 0) == 1


def test_cancel_frees_the_slot_within_a_round(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=1)
    started = threading.Event()
    finished = threading.Event()
    reasons = []

    def on_chunk(chunk):
        started.set()
        if chunk.finished:
            reasons.append(chunk.finish_reason)
            finished.set()

    rid = engine.submit(_req(max_tokens=400, ignore_eos=True, tree=TreeSettings(method="ar")), on_chunk)
    assert started.wait(30)
    engine.cancel(rid)
    assert finished.wait(5)
    assert reasons == ["cancelled"]
    t0 = time.perf_counter()
    (out,) = engine.generate([_req(max_tokens=4, ignore_eos=True)])  # the single slot is free again
    assert len(out.token_ids) == 4 and time.perf_counter() - t0 < 30


def test_stop_rules(tiny_engine_factory, tiny_tokenizer):
    engine = tiny_engine_factory(oracle=True)
    (free,) = engine.generate([_req(max_tokens=40, ignore_eos=True)])
    stop_id = free.token_ids[5]
    (by_id,) = engine.generate([_req(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,))])
    first = free.token_ids.index(stop_id)
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    (by_str,) = engine.generate([_req(max_tokens=40, ignore_eos=True, stop=(needle,))])
    assert by_str.finish_reason == "stop"
    assert by_str.text == text[: text.index(needle)]
    (by_len,) = engine.generate([_req(max_tokens=7, ignore_eos=True)])
    assert len(by_len.token_ids) == 7 and by_len.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_engine_factory, tiny_pair, tiny_tokenizer, monkeypatch):
    engine = tiny_engine_factory(oracle=True)
    (free,) = engine.generate([_req(max_tokens=30, ignore_eos=True)])
    # pretend the 4th generated token is the end-of-text token
    monkeypatch.setattr(engine, "eos_ids", frozenset({free.token_ids[3]}))
    (out,) = engine.generate([_req(max_tokens=30)])
    assert out.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[3]) + 1]
    assert out.finish_reason == "stop"
    (ignored,) = engine.generate([_req(max_tokens=30, ignore_eos=True)])
    assert ignored.token_ids == free.token_ids


def test_stream_equals_generate_and_carries_stats(tiny_engine_factory):
    engine = tiny_engine_factory(oracle=True)
    req = _req(max_tokens=32, ignore_eos=True, tree=TreeSettings(method="ddtree", budget=16))
    (blocking,) = engine.generate([req])

    async def consume():
        chunks = []
        async for chunk in engine.stream(req):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(consume())
    assert [t for c in chunks for t in c.token_ids] == blocking.token_ids
    assert "".join(c.text for c in chunks) == blocking.text
    final = chunks[-1]
    assert final.finished and final.stats is not None
    st = final.stats
    assert st.completion_tokens == 32
    assert st.verify_rounds == sum(st.accept_hist)
    assert st.accept_length == pytest.approx(32 / st.verify_rounds)
    # every round commits at least one token; the first token came from the prefill
    assert 1 + sum(k * c for k, c in enumerate(st.accept_hist)) >= 32
    assert st.ttft_s is not None and st.ttft_s > 0
    assert {"draft", "tree", "verify", "commit"} <= set(st.stage_s)


def test_stream_closed_early_cancels(tiny_engine_factory):
    engine = tiny_engine_factory(max_batch=1)

    async def consume_two():
        it = engine.stream(_req(max_tokens=400, ignore_eos=True, tree=TreeSettings(method="ar")))
        n = 0
        async for _ in it:
            n += 1
            if n == 2:
                break
        await it.aclose()

    asyncio.run(consume_two())
    deadline = time.time() + 5
    while engine.snapshot().running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.snapshot().running == 0


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(tiny_engine_factory, tiny_tokenizer):
    engine = tiny_engine_factory(prefill_chunk=16, max_len=512)
    long_prompt = "def f(x):\n    return x\n" * 20
    ids = tiny_tokenizer.encode(long_prompt)
    assert len(ids) > 48
    short = _req(max_tokens=30, ignore_eos=True)
    (short_alone,) = engine.generate([short])
    (long_alone,) = engine.generate([_req(long_prompt, max_tokens=8, ignore_eos=True)])
    outs = engine.generate([_req(long_prompt, max_tokens=8, ignore_eos=True), short])
    assert outs[0].token_ids == long_alone.token_ids
    assert outs[1].token_ids == short_alone.token_ids
    assert outs[0].stats.stage_s["prefill"] > 0


def test_queue_limit_counts_waiting_requests_only(tiny_engine_factory):
    """max_queue=0: a request is accepted while a slot is free and refused once it would have to wait."""
    from ddtree.errors import QueueFullError

    engine = tiny_engine_factory(max_batch=1, max_queue=0)
    started = threading.Event()
    engine.submit(_req(max_tokens=400, ignore_eos=True, tree=TreeSettings(method="ar")), lambda ch: started.set())
    assert started.wait(30)
    with pytest.raises(QueueFullError, match="queue"):
        engine.submit(_req(), lambda ch: None)


def test_a_slot_freed_while_its_next_round_runs_serves_the_next_request_exactly(tiny_engine_factory, tiny_tokenizer):
    """The loop launches round n + 1 before it commits round n, so a request ending on a stop string (not
    predictable from token ids) still has a row in the round already queued when its slot passes to a waiting
    request. With one slot the waiting request gets that very slot; its output must equal its output alone."""
    engine = tiny_engine_factory(oracle=True, max_batch=1)
    tree = TreeSettings(method="ddtree", budget=8)
    (free,) = engine.generate([_req(max_tokens=40, ignore_eos=True, tree=tree)])
    needle = free.text[len(free.text) // 3 : len(free.text) // 3 + 3]
    stopper = _req(max_tokens=40, ignore_eos=True, tree=tree, stop=(needle,))
    follower = _req(prompt="class A:\n    def m(self):\n", max_tokens=24, ignore_eos=True, tree=tree)
    (alone,) = engine.generate([follower])
    stopped, after = engine.generate([stopper, follower])
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(needle)]
    assert after.token_ids == alone.token_ids and after.finish_reason == "length"


def test_generate_keeps_at_most_max_in_flight_requests_submitted(tiny_engine_factory, monkeypatch):
    """generate(max_in_flight=2) over five requests (eight engine slots): never more than two submitted and
    unfinished at once, each output as in one unlimited batch."""
    from ddtree.errors import ConfigError

    engine = tiny_engine_factory()
    tree = TreeSettings(method="ddtree", budget=8)
    reqs = [_req(prompt=p, max_tokens=12, ignore_eos=True, tree=tree)
            for p in ("def f(x):\n", "class A:\n", "import os\n", "for i in", "x = [")]
    together = engine.generate(reqs)
    in_flight, peak = [0], [0]
    guard = threading.Lock()
    real_submit = engine.submit

    def counting_submit(request, on_chunk, **kw):
        def wrapped(chunk):
            if chunk.finished:
                with guard:
                    in_flight[0] -= 1
            on_chunk(chunk)

        with guard:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        return real_submit(request, wrapped, **kw)

    monkeypatch.setattr(engine, "submit", counting_submit)
    limited = engine.generate(reqs, max_in_flight=2)
    assert peak[0] == 2  # the second is submitted right after the first, long before either finishes
    assert [o.token_ids for o in limited] == [o.token_ids for o in together]
    with pytest.raises(ConfigError, match="max_in_flight"):
        engine.generate(reqs, max_in_flight=0)


def test_a_failed_request_frees_its_place_in_the_loop(tiny_engine_factory, tiny_tokenizer, monkeypatch):
    """generate(max_in_flight=1): a request that errors still finishes, so the next one is submitted and every
    output comes back (a missed release would block generate: the test waits 60 s for it)."""
    engine = tiny_engine_factory()
    poisoned, reqs = _poisonable(engine, tiny_tokenizer, monkeypatch)
    poisoned.extend([60, 60 + 24])  # the second request's root positions
    result: list = []
    runner = threading.Thread(target=lambda: result.append(engine.generate(reqs, max_in_flight=1)), daemon=True)
    runner.start()
    runner.join(60)
    assert result, "generate(max_in_flight=1) did not return: a finished request kept its place"
    outs = result[0]
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "injected fault" in outs[1].error


@pytest.mark.parametrize("seed", range(40))
def test_ends_by_token_predicts_commit(seed):
    """The loop's prediction of which rows finish on the tokens it has not committed yet agrees with commit()
    (no stop strings: those need the text and are not predicted)."""
    import random

    from ddtree.engine.request_state import RequestState

    class _Detok:
        stopped = False

        def add(self, ids):
            return ""

        def finish(self):
            return ""

    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5,
                              stop_token_ids=tuple(rng.sample(range(20), rng.randint(0, 2))))
    state = RequestState(request_id="r", prompt_ids=[1] * rng.randint(1, 8), tree=TreeSettings(), sampling=sampling,
                         seed=0, on_chunk=lambda chunk: None, detok=_Detok(), eos_ids=frozenset({rng.randrange(20)}),
                         max_len=rng.randint(10, 24))
    state.output_ids = [21] * rng.randint(0, min(sampling.max_tokens, state.max_len - len(state.prompt_ids)) - 1)
    tokens = [rng.randrange(20) for _ in range(rng.randint(0, 6))]
    predicted = state.ends_by_token(tokens)
    _, _, reason = state.commit(tokens)
    assert predicted == (reason is not None)


def test_prefill_graph_inputs_reach_the_right_rows(tiny_engine_factory, tiny_tokenizer, monkeypatch):
    """PrefillGraphs' host packing (bucketed rows and widths, scratch-slot padding rows, valid lengths, the last
    token's logits) on a CPU: its graph recorder swapped for one that reruns the prefill into the same output
    buffer. The short prompts take the graphed path however the engine groups them; the long one (150 tokens:
    chunks of 64, 64 and 22) is chunked eagerly, its last chunk too although it fits a graph (it does not start at
    position 0); every output must equal the plain engine's."""
    import torch

    from ddtree.engine.cuda_graphs import PrefillGraphs

    prompts = ["def f(x):\n", "class Stack:\n    def push(self, x):\n", "x = ["]
    tree = TreeSettings(method="ddtree", budget=8)
    reqs = [_req(prompt=p, max_tokens=10, ignore_eos=True, tree=tree) for p in prompts]
    long_ids = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(0)).tolist()  # not repetitive
    reqs.append(GenerationRequest(prompt_token_ids=long_ids, tree=tree,
                                  sampling=SamplingParams(max_tokens=10, ignore_eos=True)))
    # mixed rounds off: a prompt arriving while another decodes would ride in a round instead of a prefill step
    plain = tiny_engine_factory(max_batch=4, prefill_chunk=64, mixed_chunk=0).generate(reqs)

    engine = tiny_engine_factory(max_batch=4, prefill_chunk=64, mixed_chunk=0)
    graphs = PrefillGraphs(engine.runner, max_rows=4, max_width=32)

    def record(fn):
        out = fn()
        return out, lambda: out.copy_(fn())

    graphed_lens: list[int] = []
    real_run = graphs.run

    def run(ids, slots, valid_len):
        graphed_lens.extend(valid_len)
        return real_run(ids, slots, valid_len)

    monkeypatch.setattr(graphs, "_record", record)
    monkeypatch.setattr(graphs, "can_run", graphs.fits)
    monkeypatch.setattr(graphs, "run", run)
    engine.prefill_graphs = graphs
    graphed = engine.generate(reqs[:3])
    assert graphs.captures > 0
    graphed += engine.generate(reqs[3:])
    # every short prompt went through a graph whole; none of the long prompt's chunks did (its last one, 22 tokens
    # from position 128, fits a graph's width but not its start)
    assert sorted(graphed_lens) == sorted(len(tiny_tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in plain]


def test_a_prefill_graph_that_fails_to_capture_falls_back_to_eager(tiny_engine_factory, monkeypatch):
    """A capture that raises (out of memory, an op graphs refuse) disables prefill graphs; the requests still
    prefill eagerly and decode as the plain engine does."""
    from ddtree.engine.cuda_graphs import PrefillGraphs

    reqs = [_req(prompt=p, max_tokens=8, ignore_eos=True) for p in ("def f(x):\n", "x = [")]
    plain = tiny_engine_factory(max_batch=2).generate(reqs)
    engine = tiny_engine_factory(max_batch=2)
    graphs = PrefillGraphs(engine.runner, max_rows=2, max_width=32)

    def broken(fn):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(graphs, "_record", broken)
    monkeypatch.setattr(graphs, "can_run", graphs.fits)
    engine.prefill_graphs = graphs
    outs = engine.generate(reqs)
    assert engine.prefill_graphs is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_prefill_graphs_past_their_cap_prefill_eagerly(tiny_engine_factory, tiny_tokenizer, monkeypatch):
    """At ``max_graphs`` captured shapes a new shape prefills eagerly (no eviction, no recapture: a capture costs
    more than a graph saves on one prompt); shapes already captured keep replaying. Outputs equal the plain
    engine's either way."""
    from ddtree.engine.cuda_graphs import PrefillGraphs

    text = tiny_tokenizer.encode("def f(x):\n    return [x, x + 1]\n" * 20, add_special_tokens=False)
    widths = (5, 20, 40)  # three width buckets (16, 32, 64), one graph allowed
    reqs = [GenerationRequest(prompt_token_ids=text[:w], sampling=SamplingParams(max_tokens=6, ignore_eos=True))
            for w in widths]
    plain = tiny_engine_factory(max_batch=1).generate(reqs)
    engine = tiny_engine_factory(max_batch=1)
    graphs = PrefillGraphs(engine.runner, max_rows=1, max_width=64, max_graphs=1)
    assert len(text) >= 40 and len({graphs.key_for(1, w) for w in widths}) == 3
    replays = []

    def record(fn):
        out = fn()

        def replay():
            replays.append(1)
            out.copy_(fn())

        return out, replay

    monkeypatch.setattr(graphs, "_record", record)
    monkeypatch.setattr(graphs, "can_run", graphs.fits)
    engine.prefill_graphs = graphs
    outs = [engine.generate([r])[0] for r in reqs + reqs[:1]]
    assert graphs.captures == 1 and len(graphs.graphs) == 1
    assert len(replays) == 2  # the first prompt, captured and then replayed; the other two eager
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain + plain[:1]]


def test_prefill_graph_padding_rows_write_only_the_scratch_slot(tiny_pair, monkeypatch):
    """Three prompts in a 4-row graph: each row's logits and cache entries equal an eager prefill of that prompt
    alone, and the padding row leaves every other slot (here a live one, 3) untouched in both caches. Deterministic,
    unlike the engine-level test, whose grouping of arrivals decides whether a padding row exists at all."""
    import torch

    from ddtree.engine.cuda_graphs import PrefillGraphs
    from ddtree.engine.kernels import KernelSet
    from ddtree.engine.runner import ModelRunner, PrefillInputs

    target, drafter = tiny_pair
    gen = torch.Generator().manual_seed(0)
    lens, slots = [5, 9, 3], [2, 0, 1]
    ids = torch.zeros(3, 9, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, :n] = torch.randint(1, 60, (n,), generator=gen)
    graphed = ModelRunner(target, drafter, slots=4, cache_len=48, kernels=KernelSet.torch())
    eager = ModelRunner(target, drafter, slots=4, cache_len=48, kernels=KernelSet.torch())
    for cache in (graphed.target_cache, graphed.drafter_cache):
        cache.k.normal_(generator=gen)
        cache.v.normal_(generator=gen)
    before = [(c.k[:, 3].clone(), c.v[:, 3].clone()) for c in (graphed.target_cache, graphed.drafter_cache)]
    graphs = PrefillGraphs(graphed, max_rows=4, max_width=32)

    def record(fn):
        out = fn()
        return out, lambda: out.copy_(fn())

    monkeypatch.setattr(graphs, "_record", record)
    assert graphs.key_for(3, 9).rows == 4  # one padding row
    logits = graphs.run(ids, slots, lens).clone()
    for r, (n, slot) in enumerate(zip(lens, slots, strict=True)):
        one = torch.tensor([slot])
        want = eager.prefill(PrefillInputs(ids=ids[r:r + 1, :n], slots=one, start=torch.zeros(1, dtype=torch.long),
                                           valid_len=torch.tensor([n]), last_index=torch.tensor([n - 1]), kv_len=n))
        torch.testing.assert_close(logits[r], want[0], rtol=1e-5, atol=1e-5)
        for got, ref in ((graphed.target_cache, eager.target_cache), (graphed.drafter_cache, eager.drafter_cache)):
            torch.testing.assert_close(got.k[:, slot, :, :n], ref.k[:, slot, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.v[:, slot, :, :n], ref.v[:, slot, :, :n], rtol=1e-5, atol=1e-5)
    for cache, (k, v) in zip((graphed.target_cache, graphed.drafter_cache), before, strict=True):
        assert torch.equal(cache.k[:, 3], k) and torch.equal(cache.v[:, 3], v)


def test_start_freezes_what_start_up_made_and_shutdown_unfreezes(tiny_engine_factory):
    """Engine.start() moves start-up's objects out of the collector's generations (a full collection in the serving
    loop then walks only what requests allocate); shutdown() hands them back."""
    import gc

    gc.unfreeze()
    engine = tiny_engine_factory()
    assert gc.get_freeze_count() > 0
    (out,) = engine.generate([_req(max_tokens=4, ignore_eos=True)])
    assert len(out.token_ids) == 4  # serving still works frozen
    engine.shutdown(drain_timeout=0)
    assert gc.get_freeze_count() == 0
