"""``min_tokens``: EOS and the stop token ids are masked out of the target's distribution until min_tokens tokens
are out, at every tree node, so AR, DFlash and DDTree emit the same tokens.

Reference: a plain greedy decoder loop written here, one full forward of the target (``forward_train``, no KV cache,
no trees) per token, with the banned ids set to -inf while fewer than min_tokens tokens are out.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.request_state import RequestState
from ddtree.errors import InvalidRequestError

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x"]
METHODS = [TreeSettings(method="ar"), TreeSettings(method="dflash"), TreeSettings(method="ddtree", budget=16),
           TreeSettings(method="ddtree", budget=6, topk=2, block_size=5)]
MIN_TOKENS = 12


def reference(target, prompt_ids: list[int], banned: set[int], min_tokens: int, max_tokens: int) -> list[int]:
    """Greedy decoding by full forwards; stops at the first banned id once min_tokens tokens are out."""
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens:
            logits = target.forward_train(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            if len(out) < min_tokens:
                logits[list(banned)] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            if tok in banned:
                break
    return out


def _early_stop_ids(engine) -> list[tuple[int, ...]]:
    """Per prompt, stop token ids that end greedy AR's output early without min_tokens: the first token it emits
    (which only the prefill's mask can hold back) and, where the masked run then changes token at some index j >= 1,
    the token at j (the tiny target repeats a token, then switches: only a round's mask can hold that one back, since
    banning it leaves every earlier argmax alone)."""
    def run(stops: list[tuple[int, ...]]) -> list[list[int]]:
        return [o.token_ids for o in engine.generate(_requests(stops, METHODS[0], min_tokens=24, eos=False))]

    first = [(ids[0],) for ids in run([()] * len(PROMPTS))]
    out = []
    for stop, ids in zip(first, run(first), strict=True):
        later = [t for t in ids[1:MIN_TOKENS] if t != ids[0]]
        out.append(stop + tuple(later[:1]))
    assert any(len(s) == 2 for s in out)  # some prompt exercises the verify's mask
    return out


def _requests(stops, tree, *, min_tokens, temperature=0.0, seed=None, max_tokens=24, eos=True):
    return [GenerationRequest(prompt=p, tree=tree,
                              sampling=SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                                      stop_token_ids=stop, temperature=temperature, seed=seed,
                                                      ignore_eos=not eos))
            for p, stop in zip(PROMPTS, stops, strict=True)]


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_greedy_min_tokens_holds_for_every_method_and_matches_the_reference(tiny_engine_factory, tiny_pair, oracle):
    target, _ = tiny_pair
    engine = tiny_engine_factory(oracle=oracle)
    stops = _early_stop_ids(engine)
    without = engine.generate(_requests(stops, METHODS[0], min_tokens=0))
    assert all(o.finish_reason == "stop" and len(o.token_ids) < MIN_TOKENS for o in without)
    ar = engine.generate(_requests(stops, METHODS[0], min_tokens=MIN_TOKENS))
    for out, stop in zip(ar, stops, strict=True):
        banned = set(stop) | set(engine.eos_ids)
        assert len(out.token_ids) >= MIN_TOKENS
        assert not banned & set(out.token_ids[:MIN_TOKENS])
        assert out.token_ids == reference(target, out.prompt_token_ids, banned, MIN_TOKENS, 24)
    for tree in METHODS[1:]:
        for out, base in zip(engine.generate(_requests(stops, tree, min_tokens=MIN_TOKENS)), ar, strict=True):
            assert out.token_ids == base.token_ids, tree
            assert out.finish_reason == base.finish_reason


def test_sampled_min_tokens_is_lossless_across_methods(tiny_engine_factory):
    engine = tiny_engine_factory(oracle=True)
    stops = _early_stop_ids(engine)
    ar = engine.generate(_requests(stops, METHODS[0], min_tokens=MIN_TOKENS, temperature=1.0, seed=3))
    for out, stop in zip(ar, stops, strict=True):
        assert len(out.token_ids) >= MIN_TOKENS
        assert not (set(stop) | set(engine.eos_ids)) & set(out.token_ids[:MIN_TOKENS])
    for tree in METHODS[1:]:
        outs = engine.generate(_requests(stops, tree, min_tokens=MIN_TOKENS, temperature=1.0, seed=3))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ar], tree


def test_a_batch_mixing_min_tokens_rows_and_plain_rows_changes_neither(tiny_engine_factory):
    """Each row's mask is its own: a plain row batched with a min_tokens row still stops on its stop id at once."""
    engine = tiny_engine_factory(oracle=True)
    stops = _early_stop_ids(engine)
    mixed = [r for r in _requests(stops, METHODS[2], min_tokens=MIN_TOKENS)[:2]]
    plain = _requests(stops, METHODS[2], min_tokens=0)[2]
    outs = engine.generate([*mixed, plain])
    assert all(len(o.token_ids) >= MIN_TOKENS for o in outs[:2])
    alone = engine.generate([plain])[0]
    assert outs[2].token_ids == alone.token_ids and len(alone.token_ids) < MIN_TOKENS and alone.finish_reason == "stop"


def test_min_tokens_out_of_range_is_an_error_naming_it():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=4, min_tokens=5).validated()
    assert err.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(min_tokens=-1).validated()
    assert err.value.param == "min_tokens"


class _Tok:
    """A detokenizer's tokenizer: token i is the i-th letter of the alphabet."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_stop_strings_are_not_matched_before_min_tokens():
    from ddtree.engine.detok import IncrementalDetokenizer

    def run(min_tokens: int) -> tuple[str, str | None]:
        state = RequestState(request_id="r", prompt_ids=[0], tree=METHODS[0],
                             sampling=SamplingParams(max_tokens=10, min_tokens=min_tokens, stop=("b",)), seed=0,
                             on_chunk=lambda c: None, detok=IncrementalDetokenizer(_Tok(), stop=("b",)),
                             eos_ids=frozenset(), max_len=100)
        text, reason = "", None
        for toks in ([0, 1, 2], [3, 1, 4]):  # "abc", "dbe": "b" at output index 1 and 4
            _, delta, reason = state.commit(toks)
            text += delta
            if reason:
                break
        return text, reason

    assert run(0) == ("a", "stop")
    assert run(3) == ("abcd", "stop")  # the first "b" (index 1) is before min_tokens, the second stops it


def test_the_mask_by_hand():
    """Row 0 bans ids 1 and 3 below output index 2; row 1 bans nothing (-1) and an id past the vocabulary."""
    from ddtree.engine.min_tokens import mask_min_tokens

    logits = torch.zeros(2, 3, 4)
    banned = torch.tensor([[1, -1], [3, 99]])  # [B, R]
    out = mask_min_tokens(logits, banned, torch.tensor([2, 5]), torch.tensor([[0, 1, 2], [0, 1, 2]]))
    inf = float("-inf")
    assert out[0].tolist() == [[0, inf, 0, inf], [0, inf, 0, inf], [0, 0, 0, 0]]
    assert out[1].tolist() == [[0, 0, 0, 0]] * 3
    assert logits.eq(0).all()  # the raw logits (log-probs read them) are left alone
