"""Log-probs: the target's raw distribution at every emitted token (and every prompt token for ``echo``).

References: AR's log-probs for the same tokens, and a plain full forward of the target over prompt + output
(``forward_train``, no KV cache, no trees) followed by ``log_softmax``, written here.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings
from ddtree.errors import InvalidRequestError

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x"]
METHODS = [TreeSettings(method="ar"), TreeSettings(method="dflash"), TreeSettings(method="ddtree", budget=16),
           TreeSettings(method="ddtree", budget=6, topk=2, block_size=5)]
N_TOP = 5


def close(a: float, b: float) -> bool:
    """Equal to 1e-5 (relative past magnitude 1: a cached forward and a full recompute differ by fp32 rounding)."""
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def reference(target, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over prompt + output: row p is the distribution of the token at p + 1."""
    with torch.inference_mode():
        logits = target.forward_train(torch.tensor([prompt_ids + output_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _generate(engine, tokenizer, tree, *, temperature=0.0, n=24, prompt_logprobs=None, seed=None):
    reqs = [GenerationRequest(prompt=p, tree=tree,
                              sampling=SamplingParams(max_tokens=n, ignore_eos=True, logprobs=N_TOP,
                                                      prompt_logprobs=prompt_logprobs, temperature=temperature,
                                                      seed=seed))
            for p in PROMPTS]
    return engine.generate(reqs)


def _check_against_reference(target, out) -> None:
    ref = reference(target, out.prompt_token_ids, out.token_ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    start = len(out.prompt_token_ids) - 1
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[start + j]
        assert entry.token_id == tok
        assert close(entry.logprob, float(row[tok])), (j, entry.logprob, float(row[tok]))
        values, ids = torch.topk(row, N_TOP)
        assert [i for i, _ in entry.top] == ids.tolist(), j
        assert all(close(v, float(r)) for (_, v), r in zip(entry.top, values, strict=True)), j


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_greedy_logprobs_of_every_method_equal_ar_and_the_full_forward(tiny_engine_factory, tiny_tokenizer,
                                                                     tiny_pair, oracle):
    target, _ = tiny_pair
    engine = tiny_engine_factory(oracle=oracle)
    ar = _generate(engine, tiny_tokenizer, METHODS[0])
    for out in ar:
        _check_against_reference(target, out)
    for tree in METHODS[1:]:
        for out, base in zip(_generate(engine, tiny_tokenizer, tree), ar, strict=True):
            assert out.token_ids == base.token_ids, tree
            _check_against_reference(target, out)
            for a, b in zip(out.logprobs, base.logprobs, strict=True):
                assert a.token_id == b.token_id and close(a.logprob, b.logprob)
                assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_sampled_logprobs_are_the_raw_distribution_of_the_tokens_drawn(tiny_engine_factory, tiny_tokenizer,
                                                                      tiny_pair):
    """At temperature 1.3 the tokens are samples; their log-probs are still the target's raw (temperature-free)
    distribution at each, for DDTree as for AR (which draw the same tokens: sampling is lossless and seeded)."""
    target, _ = tiny_pair
    engine = tiny_engine_factory(oracle=True)
    ar = _generate(engine, tiny_tokenizer, METHODS[0], temperature=1.3, seed=7)
    tree = _generate(engine, tiny_tokenizer, METHODS[2], temperature=1.3, seed=7)
    for a, t in zip(ar, tree, strict=True):
        _check_against_reference(target, a)
        _check_against_reference(target, t)


def test_prompt_logprobs_equal_the_full_forward_and_the_first_is_none(tiny_engine_factory, tiny_tokenizer,
                                                                     tiny_pair):
    """Prompts longer than one prefill chunk too: a chunk's last column predicts the next chunk's first token."""
    target, _ = tiny_pair
    engine = tiny_engine_factory(prefill_chunk=16)
    long_prompt = "def g(x):\n    return x + 1\n" * 6
    reqs = [GenerationRequest(prompt=p, tree=TreeSettings(method="ddtree", budget=8),
                              sampling=SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3))
            for p in [*PROMPTS, long_prompt]]
    for out in engine.generate(reqs):
        prompt = out.prompt_token_ids
        assert out.logprobs is None  # not asked
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        ref = reference(target, prompt, [])
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert entry.token_id == prompt[p]
            assert close(entry.logprob, float(ref[p - 1, prompt[p]]))
            assert [i for i, _ in entry.top] == torch.topk(ref[p - 1], 3).indices.tolist()
    assert len(long_prompt) > 16


def test_rows_without_logprobs_get_none_and_share_rounds_with_those_that_ask(tiny_engine_factory, tiny_tokenizer):
    engine = tiny_engine_factory(oracle=True)
    tree = TreeSettings(method="ddtree", budget=8)
    asks = GenerationRequest(prompt=PROMPTS[0], tree=tree,
                             sampling=SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0))
    plain = GenerationRequest(prompt=PROMPTS[0], tree=tree, sampling=SamplingParams(max_tokens=16, ignore_eos=True))
    a, b = engine.generate([asks, plain])
    assert a.token_ids == b.token_ids
    assert b.logprobs is None and b.prompt_logprobs is None
    assert len(a.logprobs) == 16 and all(e.top == () for e in a.logprobs)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_out_of_range_logprobs_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validated()
    assert info.value.param == field


def test_round_logprob_columns_sync_nothing_and_round_trip_exactly():
    """pack_round_logprobs runs inside a round (and a captured graph): no op may read a device value on the host.
    Its float columns come back bit for bit, -inf included, and in the documented layout."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ddtree.engine.logprobs import bits_to_floats, pack_round_logprobs, unpack_logprobs

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 30, generator=gen)
    logits[1, 4, 1] = float("-inf")
    path = torch.tensor([[0, 2, 2], [0, 4, 4]])
    tokens = torch.tensor([[5, 9, 9], [7, 1, 1]])
    with Ops() as ops:
        cols = pack_round_logprobs(logits, path, tokens, k=4)
    assert not ops.names & {"_local_scalar_dense", "nonzero", "masked_select", "unique", "item"}
    assert cols.shape == (2, 3 * (1 + 2 * 4)) and cols.dtype == torch.long
    row = cols[1].tolist()
    entries = unpack_logprobs(row, [7, 1], 3, 4, 2)
    ref = torch.log_softmax(logits[1], -1)
    assert entries[0].logprob == float(ref[0, 7]) and entries[1].logprob == float("-inf")  # token 1 at node 4
    assert [i for i, _ in entries[0].top] == torch.topk(ref[0], 2).indices.tolist()
    assert bits_to_floats(row[:3])[0] == float(ref[0, 7])
