"""EngineConfig.prefill_every: while requests decode, arrivals start prefilling at most once every N rounds.

References: the plain full-recompute decoder (greedy, fp32) for every output, and a spy on the scheduler that
records each prefill step (the rounds queued by then, whether some request decoded, the requests it took and when
each was admitted), to check the bound the setting states and that arrivals really shared steps.
"""

from __future__ import annotations

import pytest
from engine_helpers import plain_greedy, submit_staggered

from ddtree.engine import EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.config import PREFILL_EVERY_CUDA, resolve_prefill_every
from ddtree.engine.engine import Engine
from ddtree.engine.request_state import Phase
from ddtree.errors import ConfigError

PROMPTS = [
    "def fibonacci(n):\n    ",
    "x",
    "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, mode='r', *, strict=True):\n        ",
]
N = 24
EVERY = 3


@pytest.fixture(scope="module")
def references(tiny_pair, tiny_tokenizer):
    return {p: plain_greedy(tiny_pair[0], tiny_tokenizer.encode(p), N) for p in PROMPTS}


@pytest.fixture
def steps(monkeypatch) -> list[dict]:
    """Every prefill step: {"round": rounds queued before it, "decoding": whether a request decoded, "first":
    [(rounds queued at the request's admission) for each request starting its prompt in it]}."""
    seen: list[dict] = []
    admitted: dict[int, int] = {}
    real_admit, real_step = Engine._admit, Engine._prefill_step

    def admit(self):
        before = set(self._active)
        real_admit(self)
        for slot in set(self._active) - before:
            admitted[id(self._active[slot])] = self._rounds_queued

    def step(self, states):
        decoding = any(s.phase is Phase.DECODE for s in self._active.values())
        seen.append({"round": self._rounds_queued, "decoding": decoding,
                     "first": [admitted[id(s)] for s in states if s.prefilled == 0]})
        return real_step(self, states)

    monkeypatch.setattr(Engine, "_admit", admit)
    monkeypatch.setattr(Engine, "_prefill_step", step)
    return seen


def _requests(n: int) -> list[GenerationRequest]:
    tree = TreeSettings(method="ddtree", budget=6)
    return [GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], tree=tree,
                              sampling=SamplingParams(max_tokens=N, ignore_eos=True)) for i in range(n)]


def test_arrivals_share_prefill_steps_within_the_bound(tiny_engine_factory, references, steps):
    """Requests arriving while others decode: prefill steps beside decoding rows come at least EVERY rounds apart,
    no newcomer waits more than EVERY rounds from its admission for its step, some step takes several newcomers,
    and every output is the plain decoder's."""
    engine = tiny_engine_factory(oracle=True, max_batch=8, prefill_every=EVERY)
    reqs = _requests(12)
    outs = submit_staggered(engine, reqs, 0.005)
    assert outs == [references[r.prompt] for r in reqs]
    beside = [s for s in steps if s["decoding"]]
    assert beside, steps  # the guard: arrivals did come while others decoded
    for a, b in zip(beside, beside[1:], strict=False):
        assert b["round"] - a["round"] >= EVERY, steps
    for s in beside:
        assert all(s["round"] - at <= EVERY for at in s["first"]), steps
    assert any(len(s["first"]) > 1 for s in beside), steps


def test_every_round_is_the_cpu_default(tiny_engine_factory, references, steps):
    """prefill_every None (the default) is 1 on the CPU: an arrival is prefilled in the iteration it is admitted in."""
    assert EngineConfig().prefill_every is None
    engine = tiny_engine_factory(oracle=True, max_batch=8)
    assert engine.config.prefill_every == 1
    reqs = _requests(6)
    outs = submit_staggered(engine, reqs, 0.02)
    assert outs == [references[r.prompt] for r in reqs]
    assert all(s["round"] == at for s in steps for at in s["first"]), steps


def test_the_default_resolves_per_device():
    """None: PREFILL_EVERY_CUDA on CUDA, 1 elsewhere; a value given is kept on every device."""
    assert PREFILL_EVERY_CUDA > 1
    assert resolve_prefill_every(None, "cuda") == PREFILL_EVERY_CUDA
    assert resolve_prefill_every(None, "cpu") == 1
    assert resolve_prefill_every(1, "cuda") == 1
    assert resolve_prefill_every(5, "cpu") == 5


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_a_bad_prefill_every_is_refused(value):
    with pytest.raises(ConfigError, match="prefill_every"):
        EngineConfig(prefill_every=value).validated()
