"""A prefill step's size: ``prefill_chunk`` tokens a prompt, ``prefill_step_tokens`` a step with its padding.

References: a brute-force oracle of the stated rule (rows and widest row rounded up to powers of two by counting,
width at least 16, their product within the step; a single row always), the plain full-recompute decoder (greedy,
fp32) for the engine's outputs, and a spy on the scheduler's steps.
"""

from __future__ import annotations

import random

import pytest
from engine_helpers import plain_greedy

from ddtree.engine import EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.engine import Engine
from ddtree.engine.prefill_budget import (
    PREFILL_STEP_TOKENS_CUDA,
    resolve_step_tokens,
    step_fits,
    step_shapes,
    step_takes,
)
from ddtree.errors import ConfigError


def _up(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _padded(rows: int, widest: int) -> int:
    return _up(rows) * max(16, _up(widest))


def _oracle_takes(left: list[int], chunk: int, step: int) -> list[int]:
    """The longest admission-order prefix whose padded size fits (a single row always does)."""
    best: list[int] = [min(left[0], chunk)]
    for k in range(2, len(left) + 1):
        takes = [min(n, chunk) for n in left[:k]]
        if _padded(k, max(takes)) > step:
            break
        best = takes
    return best


def test_step_takes_match_the_brute_force_rule():
    rng = random.Random(7)
    for _ in range(3000):
        chunk = rng.choice([16, 24, 64, 100, 512])
        step = chunk * rng.choice([1, 2, 3, 4, 8])
        left = [rng.randint(1, 3 * chunk) for _ in range(rng.randint(1, 40))]
        got = step_takes(left, chunk=chunk, step_tokens=step)
        assert got == _oracle_takes(left, chunk, step), (left, chunk, step)
        assert len(got) == 1 or _padded(len(got), max(got)) <= step


def test_step_shapes_are_every_fitting_step():
    for chunk, step, batch in ((16, 16, 8), (16, 64, 8), (64, 512, 6), (512, 2048, 64), (100, 300, 12)):
        shapes = dict(step_shapes(max_batch=batch, chunk=chunk, step_tokens=step))
        for rows in range(1, batch + 1):
            fitting = [w for w in range(1, chunk + 1) if rows == 1 or _padded(rows, w) <= step]
            assert all(step_fits(rows, w, chunk=chunk, step_tokens=step) == (w in fitting) for w in range(1, chunk + 2))
            if fitting:  # widths fit from 1 up to a largest one
                assert fitting == list(range(1, max(fitting) + 1)) and shapes[rows] == max(fitting), (chunk, step, rows)
            else:
                assert rows not in shapes


def test_the_default_follows_the_device_and_is_validated():
    assert resolve_step_tokens(None, 512, "cuda") == PREFILL_STEP_TOKENS_CUDA == 2048
    assert resolve_step_tokens(None, 4096, "cuda") == 4096  # never below a prompt's chunk
    assert resolve_step_tokens(None, 512, "cpu") == 512
    assert resolve_step_tokens(1024, 512, "cpu") == 1024
    for bad in (100, True, 1.5, "2048"):
        with pytest.raises(ConfigError, match="prefill_step_tokens"):
            EngineConfig(prefill_chunk=128, prefill_step_tokens=bad).validated()
    EngineConfig(prefill_chunk=128, prefill_step_tokens=128).validated()


PROMPTS = [
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, mode='r', *, strict=True):\n        ",
    "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
]
N = 16


@pytest.fixture
def step_rows(monkeypatch) -> list[list[tuple[int, int]]]:
    """Every prefill step's rows: (tokens already prefilled, tokens taken) per prompt."""
    seen: list[list[tuple[int, int]]] = []
    real = Engine._step_rows

    def spy(self, states):
        rows = real(self, states)
        seen.append([(s.prefilled, take) for s, take in rows])
        return rows

    monkeypatch.setattr(Engine, "_step_rows", spy)
    return seen


@pytest.mark.parametrize("step", [16, 64])
def test_steps_take_as_many_prompts_as_the_step_holds(tiny_engine_factory, tiny_pair, tiny_tokenizer, step_rows,
                                                      step):
    """Four prompts of 25-45 tokens arriving together, chunk 16: steps of 16 take one prompt's chunk each, steps of
    64 take up to four chunks at once (so fewer steps), every step within its padded size, and every output is the
    plain decoder's."""
    lens = [len(tiny_tokenizer.encode(p)) for p in PROMPTS]
    assert min(lens) > 16, lens  # the guard: every prompt is chunked
    engine = tiny_engine_factory(oracle=True, max_batch=4, prefill_chunk=16, prefill_step_tokens=step)
    tree = TreeSettings(method="ddtree", budget=4)
    reqs = [GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=N, ignore_eos=True))
            for p in PROMPTS]
    step_rows.clear()  # the engine's own start-up steps
    outs = [r.token_ids for r in engine.generate(reqs)]
    assert outs == [plain_greedy(tiny_pair[0], tiny_tokenizer.encode(p), N) for p in PROMPTS]
    assert step_rows and all(take <= 16 for rows in step_rows for _, take in rows)
    assert all(len(rows) == 1 or _padded(len(rows), max(t for _, t in rows)) <= step for rows in step_rows)
    assert sum(t for rows in step_rows for _, t in rows) == sum(lens)
    if step == 16:
        assert all(len(rows) == 1 for rows in step_rows)
    else:
        assert max(len(rows) for rows in step_rows) == 4, step_rows
        assert len(step_rows) < sum(-(-n // 16) for n in lens)
