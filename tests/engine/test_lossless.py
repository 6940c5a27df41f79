"""Greedy losslessness: every method and tree setting gives exactly the plain decoder's tokens.

The reference is a plain decoder written here: full recompute of the whole sequence with ``forward_train`` at
every step (no KV cache, no trees, no masks built by the engine), taking the argmax.
"""

from __future__ import annotations

import pytest
from engine_helpers import plain_greedy, submit_staggered

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
    "x",
    "    return '\\n'.join(lines)\n\n\ndef wrap(text, width=70, **kwargs):\n",
]

SETTINGS = [
    TreeSettings(method="dflash"),
    TreeSettings(method="dflash", block_size=4),
    TreeSettings(method="ddtree", budget=1),
    TreeSettings(method="ddtree", budget=4, topk=2),
    TreeSettings(method="ddtree", budget=16),
    TreeSettings(method="ddtree", budget=32, topk=4, block_size=6),
    TreeSettings(method="ddtree", budget=24, draft_window=8),
]


@pytest.fixture(scope="module")
def references(tiny_pair, tiny_tokenizer):
    target, _ = tiny_pair
    return {p: plain_greedy(target, tiny_tokenizer.encode(p), 40) for p in PROMPTS}


def _requests(tokenizer, tree, n=40):
    return [
        GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=n, ignore_eos=True))
        for p in PROMPTS
    ]


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_every_setting_matches_the_plain_decoder(tiny_engine_factory, tiny_tokenizer, references, oracle):
    engine = tiny_engine_factory(oracle=oracle)
    ar = engine.generate(_requests(tiny_tokenizer, TreeSettings(method="ar")))
    for out, p in zip(ar, PROMPTS, strict=False):
        assert out.token_ids == references[p], "AR differs from the plain decoder"
    for tree in SETTINGS:
        outs = engine.generate(_requests(tiny_tokenizer, tree))
        for out, p in zip(outs, PROMPTS, strict=False):
            assert out.finish_reason == "length"
            assert out.token_ids == references[p], f"{tree} differs from the plain decoder on {p!r}"


def test_oracle_drafter_really_exercises_deep_trees(tiny_engine_factory, tiny_tokenizer):
    """Guard for the test above: with the oracle the trees accept several tokens per round, siblings included."""
    engine = tiny_engine_factory(oracle=True)
    chain = engine.generate(_requests(tiny_tokenizer, TreeSettings(method="dflash")))
    tree = engine.generate(_requests(tiny_tokenizer, TreeSettings(method="ddtree", budget=32)))
    chain_acc = sum(o.stats.accept_length for o in chain) / len(chain)
    tree_acc = sum(o.stats.accept_length for o in tree) / len(tree)
    assert chain_acc > 1.5
    assert tree_acc > chain_acc  # siblings were accepted where the chain's guess was wrong


def test_mixed_batch_with_staggered_arrivals_matches_each_alone(tiny_engine_factory, tiny_tokenizer, references):
    """Different methods, budgets, block sizes and prompt lengths share rounds; arrivals are staggered."""

    engine = tiny_engine_factory(oracle=True, max_batch=4)
    trees = [SETTINGS[i % len(SETTINGS)] for i in range(8)] + [TreeSettings(method="ar")] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(trees))]
    reqs = [GenerationRequest(prompt=prompts[i], tree=trees[i],
                              sampling=SamplingParams(max_tokens=20 + 2 * i, ignore_eos=True)) for i in range(len(trees))]
    results = submit_staggered(engine, reqs, lambda i: 0.01 * (i % 3))
    for i, p in enumerate(prompts):
        assert results[i] == references[p][: 20 + 2 * i], f"request {i} ({trees[i]}) differs in a mixed batch"


def test_rounds_queued_before_the_previous_is_read_change_nothing(tiny_engine_factory, tiny_tokenizer, references,
                                                                   monkeypatch):
    """overlap_rounds queues round n + 1 with inputs advanced on the device from round n's result (no host read in
    between). Greedy outputs equal the plain decoder's, seeded sampled outputs equal the engine without overlap,
    and follow-up rounds really ran, also in a batch whose requests finish at different rounds."""
    from ddtree.engine.engine import Engine

    follow_ups = []
    real = Engine._follow_up
    monkeypatch.setattr(Engine, "_follow_up", lambda self, flight, *a: follow_ups.append(1) or real(self, flight, *a))
    overlapped = tiny_engine_factory(oracle=True, overlap_rounds=True)
    plain = tiny_engine_factory(oracle=True, overlap_rounds=False)
    tree = TreeSettings(method="ddtree", budget=8)
    reqs = [GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=12 + 7 * i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    outs = overlapped.generate(reqs)
    for i, (p, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert out.token_ids == references[p][: 12 + 7 * i]
    assert follow_ups, "no round was queued ahead"
    sampled = [GenerationRequest(prompt=p, tree=tree, sampling=SamplingParams(max_tokens=30, ignore_eos=True,
                                                                            temperature=0.9, seed=5 + i))
               for i, p in enumerate(PROMPTS)]
    assert [o.token_ids for o in overlapped.generate(sampled)] == [o.token_ids for o in plain.generate(sampled)]


def test_newcomers_join_the_next_round_with_their_first_token_still_on_the_device(tiny_engine_factory, references,
                                                                                   monkeypatch):
    """A prefill step does not read its first tokens: the newcomers join the round queued right after it, beside
    the rows already decoding, with their roots written on the device (Scheduler._root_patch), and the tokens are
    emitted at the next iteration. Outputs must equal the plain decoder's (a root left at its host stand-in would
    not), and such rounds must really have held other rows too. Mixed rounds off: with them a newcomer's prompt
    beside decoding rows rides in a round, whose first tokens are read with the round
    (tests/engine/test_mixed_rounds.py)."""

    from ddtree.engine.engine import Engine

    patched: list[tuple[int, int]] = []  # (rows in the round, rows patched)
    real_queue, real_patch = Engine._queue, Engine._root_patch

    def queue(self, states, *args, **kw):  # a host launch's round, or a follow-up's that newcomers joined
        out = real_queue(self, states, *args, **kw)
        if self._last_patch:
            patched.append((len(states), self._last_patch))
        self._last_patch = 0
        return out

    def root_patch(self, patch):
        self._last_patch = len(patch)
        return real_patch(self, patch)

    monkeypatch.setattr(Engine, "_queue", queue)
    monkeypatch.setattr(Engine, "_root_patch", root_patch)
    monkeypatch.setattr(Engine, "_last_patch", 0, raising=False)
    engine = tiny_engine_factory(oracle=True, max_batch=4, mixed_chunk=0)
    tree = TreeSettings(method="ddtree", budget=6)
    results = submit_staggered(engine, [GenerationRequest(prompt=prompt, tree=tree,
                                                          sampling=SamplingParams(max_tokens=16 + 3 * i, ignore_eos=True))
                                        for i, prompt in enumerate(PROMPTS * 2)], 0.02)
    for i, prompt in enumerate(PROMPTS * 2):
        assert results[i] == references[prompt][: 16 + 3 * i], f"request {i} differs"
    assert patched and any(rows > late for rows, late in patched), patched
