"""Follow-up rounds that take in newcomers (Scheduler._follow_size / _joiners / _follow_up).

A round queued before the one in flight is read now also takes the requests whose prompt was just prefilled (their
first token possibly still on the device, patched into their root there), so arrivals no longer force a host
launch after each read. References: the plain full-recompute decoder (greedy, fp32) and the same engine with rounds
launched from the host only (seeded sampling); a spy on ``_follow_up`` proves joiners really joined.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import plain_greedy, submit_staggered

from ddtree.engine import Engine, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.request_state import Phase

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, mode='r', *, strict=True):\n        ",
    "x",
    "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n",
]
# a prompt longer than a short row's reach a few rounds in: a newcomer's own position must bound the keys it reads
LONG = "def step(state, action):\n" + "    state = update(state, action)  # apply\n" * 12
N = 24
DROPPED: list[int] = []  # rows of finished requests each follow-up dropped (the joins fixture fills it)


@pytest.fixture(scope="module")
def references(tiny_pair, tiny_tokenizer):
    return {p: plain_greedy(tiny_pair[0], tiny_tokenizer.encode(p), N) for p in [*PROMPTS, LONG]}


@pytest.fixture(autouse=True)
def no_engine_warnings(caplog):
    """No round may fail or fall back: fault isolation reruns a failed round's rows alone and would hide a wrong
    queued round behind correct outputs."""
    caplog.set_level(logging.WARNING, logger="ddtree.engine")
    yield
    assert not [r for r in caplog.get_records("call") if r.name == "ddtree.engine"], caplog.text


@pytest.fixture
def joins(monkeypatch) -> list[tuple[int, int, bool, bool]]:
    """(rows of the flight, joiners, whether some joiner's first token was still unread, whether the queued round
    kept the flight's kind of round: block size and row flags) of every follow-up; a refusal of _joiners (a
    newcomer that needs another kind) appends (0, -1, False, True)."""
    seen: list[tuple[int, int, bool, bool]] = []
    dropped = DROPPED
    dropped.clear()
    kind = ("block_size", "greedy", "filtered", "contiguous", "logprobs", "min_tokens")
    real_follow, real_joiners = Engine._follow_up, Engine._joiners

    def follow_up(self, flight, size, best=None, joiners=(), riders=()):
        unread = self._unread(list(joiners))
        out = real_follow(self, flight, size, best, joiners, riders)
        same = out is None or all(getattr(out.shape, k) == getattr(flight.shape, k) for k in kind)
        live = sum(s.phase is Phase.DECODE for s in flight.states)
        seen.append((live, len(joiners), bool(unread), same))
        dropped.append(len(flight.states) - live)
        return out

    def joiners_(self, flight):
        out = real_joiners(self, flight)
        if out is None:
            seen.append((0, -1, False, True))
        return out

    monkeypatch.setattr(Engine, "_follow_up", follow_up)
    monkeypatch.setattr(Engine, "_joiners", joiners_)
    return seen


def _requests(trees, sampling=None):
    sampling = sampling or (lambda i: SamplingParams(max_tokens=N, ignore_eos=True))
    return [GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], tree=t, sampling=sampling(i))
            for i, t in enumerate(trees)]


@pytest.mark.parametrize("tree", [TreeSettings(method="ddtree", budget=6), TreeSettings(method="ddtree", budget="auto"),
                                  TreeSettings(method="dflash"), TreeSettings(method="ar")],
                         ids=["b6", "auto", "chain", "ar"])
def test_newcomers_join_queued_rounds_and_keep_the_plain_decoders_tokens(tiny_engine_factory, references, joins,
                                                                         tree):
    """Staggered arrivals of one kind of row: newcomers join rounds queued before the flight is read, with their
    first token still unread, and every output equals the plain decoder's."""
    engine = tiny_engine_factory(oracle=True, max_batch=4, cost_curve="off")
    reqs = _requests([tree] * 8)
    outs = submit_staggered(engine, reqs, 0.03)
    for out, r in zip(outs, reqs, strict=True):
        assert out == references[r.prompt]
    assert any(j > 0 and unread for _, j, unread, _ in joins), joins  # the guard: newcomers joined, unread


def test_a_long_newcomer_joining_short_rows_reads_all_its_keys(tiny_engine_factory, references, joins, tiny_tokenizer):
    """A newcomer whose prompt reaches past every row in flight (plus a block) joins a queued round: the round's
    key length must come from its position too, or its tree would not see its own prompt's end."""
    assert len(tiny_tokenizer.encode(LONG)) > 3 * 16
    engine = tiny_engine_factory(oracle=True, max_batch=2)
    tree = TreeSettings(method="ddtree", budget=6)
    reqs = [GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=N, ignore_eos=True))
            for p in [PROMPTS[2], LONG, PROMPTS[2], LONG]]
    outs = submit_staggered(engine, reqs, 0.02)
    for out, r in zip(outs, reqs, strict=True):
        assert out == references[r.prompt]
    assert any(j > 0 for _, j, _, _ in joins), joins


def test_rows_that_finished_are_dropped_from_queued_rounds(tiny_engine_factory, references, joins):
    """Requests of different lengths: one finishes on the round just read while the next round is queued from the
    device; that round drops its row on the device (a newcomer may hold the slot already) and takes the newcomers;
    every output is the plain decoder's prefix of its length."""
    engine = tiny_engine_factory(oracle=True, max_batch=3)
    tree = TreeSettings(method="ddtree", budget=6)
    lengths = [N, 5, N, 9, 13, N, 3, N]
    reqs = [GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], tree=tree,
                              sampling=SamplingParams(max_tokens=n, ignore_eos=True)) for i, n in enumerate(lengths)]
    outs = submit_staggered(engine, reqs, 0.02)
    for out, r, n in zip(outs, reqs, lengths, strict=True):
        assert out == references[r.prompt][:n]
    assert any(DROPPED), (DROPPED, joins)  # the guard: a queued round did drop a finished row
    assert any(j > 0 for _, j, _, _ in joins)


def test_a_newcomer_that_needs_another_kind_of_round_waits_for_a_host_launch(tiny_engine_factory, references,
                                                                             joins):
    """Rows of several methods share rounds (the union's shape, as a host launch makes it), but a newcomer that
    would change the flight's kind of round (a drafting row after AR rows: the block size; a tree after chain rows:
    contiguous rows) does not join a queued round: the round after the flight is launched from the host with
    everyone. Every queued round keeps its flight's kind, and the outputs are the plain decoder's."""
    engine = tiny_engine_factory(oracle=True, max_batch=4)
    trees = [TreeSettings(method="ar"), TreeSettings(method="ar"), TreeSettings(method="dflash"),
             TreeSettings(method="ddtree", budget=12, topk=3), TreeSettings(method="ddtree", budget=6)]
    reqs = _requests(trees + trees[::-1])
    outs = submit_staggered(engine, reqs, 0.03)
    for out, r in zip(outs, reqs, strict=True):
        assert out == references[r.prompt]
    assert any(j == -1 for _, j, _, _ in joins), joins  # the guard: a newcomer of another kind was refused
    assert any(j > 0 for _, j, _, _ in joins), joins  # and others joined
    assert all(same for _, _, _, same in joins), joins


def test_sampled_tokens_do_not_depend_on_how_a_newcomer_joined(tiny_engine_factory, joins):
    """Seeded sampling: a request's tokens depend on its seed and step only, so joining a queued round gives what
    a host launch gives (overlap_rounds off: every round launched from the host)."""
    trees = [TreeSettings(method="ddtree", budget=6)] * 6

    def sampling(i):
        return SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, seed=5 + i, ignore_eos=True)

    queued = submit_staggered(tiny_engine_factory(oracle=True, max_batch=4), _requests(trees, sampling), 0.03)
    assert any(j > 0 for _, j, _, _ in joins)
    host = submit_staggered(tiny_engine_factory(oracle=True, max_batch=4, overlap_rounds=False),
                            _requests(trees, sampling), 0.03)
    assert queued == host


def test_a_newcomer_that_ends_on_its_first_token_is_left_out(tiny_engine_factory, references, joins):
    """max_tokens 1, arriving while others decode: the request ends on its first token, read at the top of the
    next iteration, and never takes a row in a queued round; the others keep the plain decoder's tokens."""
    engine = tiny_engine_factory(oracle=True, max_batch=4)
    tree = TreeSettings(method="ddtree", budget=6)
    reqs = _requests([tree] * 5)
    reqs[2] = GenerationRequest(prompt=PROMPTS[2], tree=tree, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    outs = submit_staggered(engine, reqs, 0.03)
    assert outs[2] == references[PROMPTS[2]][:1]
    for i, (out, r) in enumerate(zip(outs, reqs, strict=True)):
        if i != 2:
            assert out == references[r.prompt]
    assert any(j > 0 for _, j, _, _ in joins)  # the others did join queued rounds


@pytest.mark.gpu
def test_gpu_exact_joiners_give_ar_bits(joins):
    """On CUDA in bf16 exact mode (Triton kernels, graphed rounds): with staggered arrivals newcomers join graphed
    rounds queued before the flight is read (their first token patched on the device), and every output equals AR
    alone bit for bit."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.engine import EngineConfig
    from ddtree.models import load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.bfloat16, device="cuda")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.bfloat16, device="cuda")
    config = EngineConfig(device="cuda", dtype="bfloat16", max_batch=8, max_len=1024, max_budget=16, exact=True,
                          warmup="none")
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name="demo")
    engine.start()
    try:
        prompts = [*PROMPTS, LONG, PROMPTS[0] * 3, PROMPTS[1] + PROMPTS[3]]

        def req(p, tree):
            return GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=48, ignore_eos=True))

        ar = {p: engine.generate([req(p, TreeSettings(method="ar"))])[0].token_ids for p in prompts}
        joins.clear()
        for tree in (TreeSettings(method="ddtree", budget=7), TreeSettings(method="ddtree", budget="auto")):
            outs = submit_staggered(engine, [req(p, tree) for p in prompts], 0.01)
            for p, out in zip(prompts, outs, strict=True):
                assert out == ar[p], f"{tree} differs from AR on {p[:30]!r}"
        assert any(j > 0 for _, j, _, _ in joins), joins
    finally:
        engine.shutdown()
