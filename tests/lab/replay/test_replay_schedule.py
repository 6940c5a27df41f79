"""Replay's closed loop runs the engine's schedule: the same prefill steps after the same rounds, taking the same
prompts, and the same rounds of the same rows.

Reference: the engine itself (the tiny pair, fp32, DDTree with an oracle drafter so that requests finish at
different rounds and arrivals come while others decode), watched by spies on its prefill steps, on the rounds it
queues and on what it emits; replay's loop gets each request's own commits per round (what the engine emitted) and
must place every step and every row where the engine did. With rounds launched from the host after each read
(overlap off) and with follow-ups queued before it (overlap on), prefill_every 1 and 3.
"""

from __future__ import annotations

import time

import pytest

from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.cost_curve import make_curve
from ddtree.engine.engine import Engine
from ddtree.lab.replay.throughput import FixedRounds, closed_loop

PROMPTS = ["def foo(x):\n    return", "x = [1, 2, 3]\n", "import os\nclass A:", "for i in range(10):\n",
           "def bar(y, z):\n", "while True:\n    pass\n", "print('hello')\n", "a = b + c\n"]
TOKENS = 24
SLOTS = 3


def _watch(monkeypatch, engine) -> dict[str, list]:
    """Spies: ``steps`` (rounds queued before each prefill step, prompts it took), ``rows`` (rows of each round
    queued), ``emitted`` (per request, the tokens of each emit: its first token, then each round's commits)."""
    seen: dict[str, list] = {"steps": [], "rows": [], "emitted": {}}
    real_step, real_queue, real_emit = Engine._prefill_step, Engine._queue, Engine._emit

    def step(self, states):
        seen["steps"].append((self._rounds_queued, len(states)))
        return real_step(self, states)

    def queue(self, states, *args, **kwargs):
        seen["rows"].append(len(states))
        return real_queue(self, states, *args, **kwargs)

    def emit(self, state, tokens, logprobs=None):
        seen["emitted"].setdefault(state.request_id, []).append(len(tokens))
        return real_emit(self, state, tokens, logprobs)

    monkeypatch.setattr(Engine, "_prefill_step", step)
    monkeypatch.setattr(Engine, "_queue", queue)
    monkeypatch.setattr(Engine, "_emit", emit)
    held = engine._drain_inbox
    drained: list[bool] = []

    def drain_all_at_once() -> None:  # the closed loop sends every request at once; the slots hold SLOTS of them
        while engine._inbox.qsize() < len(PROMPTS) and not drained:
            time.sleep(0.001)
        drained.append(True)
        held()

    monkeypatch.setattr(engine, "_drain_inbox", drain_all_at_once)
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["host-launched", "follow-ups"])
@pytest.mark.parametrize("every", [1, 3])
def test_replay_runs_the_engines_schedule(tiny_engine_factory, monkeypatch, every, overlap):
    engine = tiny_engine_factory(oracle=True, max_batch=SLOTS, overlap_rounds=overlap, prefill_every=every)
    seen = _watch(monkeypatch, engine)
    start = engine._rounds_queued
    outs = engine.generate([GenerationRequest(prompt=p, tree=TreeSettings(method="ddtree", budget=6),
                                              sampling=SamplingParams(max_tokens=TOKENS, ignore_eos=True))
                            for p in PROMPTS])
    commits = [seen["emitted"][o.request_id][1:] for o in outs]  # after the first token, a round each
    assert [o.stats.verify_rounds for o in outs] == [len(c) for c in commits]
    assert all(sum(c) >= TOKENS - 1 for c in commits)
    # a real check: requests finished at different rounds, so arrivals came while others decoded
    assert len({len(c) for c in commits}) > 2
    # a second a row, a second a prefill step: the loop's seconds count the rows it ran and the steps it took
    curve = make_curve("cpu", "hand", (1, 8), (0, 8), (1, 4096), lambda r, b, k: float(r),
                       prefill_tokens=(1, 4096), prefill_seconds=(1.0, 1.0))
    res = closed_loop(curve, len(PROMPTS), FixedRounds(commits, 6), context=8, concurrency=SLOTS,
                      max_tokens=TOKENS, prefill_every=every, overlap_rounds=overlap)
    assert [(at - start, took) for at, took in seen["steps"]] == list(res.steps)
    assert res.rounds == len(seen["rows"]) and res.prefill_seconds == pytest.approx(len(seen["steps"]))
    # rows: the requests' own rounds, plus with follow-ups a wasted row for each finished request, all priced
    assert sum(seen["rows"]) == res.row_rounds + (len(PROMPTS) if overlap else 0)
    assert res.round_seconds == pytest.approx(sum(seen["rows"]))
    if every > 1:  # the rule spaced the steps beside decoding rows
        beside = [at for at, _ in res.steps[1:]]
        assert all(b - a >= every for a, b in zip(beside, beside[1:], strict=False))
