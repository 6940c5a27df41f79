"""Fast checks of the pure pieces: statistics in SGLang's and vLLM's conventions (hand-computed), the text a
client sees for echo / special tokens / stop inclusion (against the tokenizer itself), and the reset routes'
admin rules over ASGI."""

from __future__ import annotations

import pytest
from server_helpers import SyncClient

from ddtree.engine.api import RequestStats, StreamChunk
from ddtree.server.app import create_app
from ddtree.server.auth import AccessPolicy
from ddtree.server.generation import TextShaper
from ddtree.server.spec_stats import (
    accepted_per_position,
    sglang_meta_info,
    spec_counts,
    vllm_speculative_decoding,
)

TREE = {"method": "ddtree", "budget": 6, "topk": None, "block_size": 4, "draft_window": None}


def stats(accept_hist, tree=TREE, completion=None) -> RequestStats:
    rounds = sum(accept_hist)
    committed = sum(k * c for k, c in enumerate(accept_hist))
    return RequestStats(prompt_tokens=5, completion_tokens=completion or committed + 1, verify_rounds=rounds,
                        accept_hist=list(accept_hist), tree=dict(tree), finish_reason="length")


def test_worked_example_of_the_conventions():
    # three rounds committed 1, 3 and 2 tokens (bonus included): accepted drafts 0, 2, 1
    s = stats([0, 1, 1, 1])
    meta = sglang_meta_info("r", s)
    assert meta["spec_accept_histogram"] == [1, 1, 1, 0]  # depth min(6, 4 - 1) = 3: four buckets
    assert meta["spec_num_correct_drafts"] == 3 and meta["spec_num_proposed_drafts"] == 18
    assert meta["spec_accept_rate"] == 3 / 18
    assert meta["spec_accept_length"] == 7 / 3  # completion tokens (6 committed + the prefill's) per round
    assert vllm_speculative_decoding(s) == {
        "num_spec_steps": 3, "num_spec_tokens": 3, "num_draft_tokens": 18, "num_accepted_draft_tokens": 3,
        "draft_acceptance_rate": 3 / 18, "mean_acceptance_length": 2.0, "acceptance_histogram": [1, 1, 1, 0]}
    assert accepted_per_position(spec_counts(s)) == [2, 1, 0]


def test_chain_and_plain_decoding():
    chain = stats([0, 2, 0, 0, 1], tree={**TREE, "method": "dflash"})  # block 4: three drafts per round
    assert vllm_speculative_decoding(chain)["num_draft_tokens"] == 9  # three rounds
    assert vllm_speculative_decoding(chain)["acceptance_histogram"] == [2, 0, 0, 1]
    ar = stats([0, 5], tree={**TREE, "method": "ar"})
    spec = vllm_speculative_decoding(ar)
    assert spec["num_draft_tokens"] == 0 and spec["acceptance_histogram"] == [5] and spec["num_spec_tokens"] == 0
    assert not spec_counts(ar).speculative


def chunk(ids, text, *, finished=False, reason=None) -> StreamChunk:
    return StreamChunk(request_id="r", token_ids=ids, text=text, finished=finished, finish_reason=reason)


def test_special_tokens_kept_when_asked(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = tiny_tokenizer.encode("hello world")
    ids = [start, *body, start]
    shaper = TextShaper(tiny_tokenizer, stop=(), stop_ids=frozenset({eos}), keep_special=True)
    text = shaper.feed(chunk(ids[:2], "")) + shaper.feed(chunk([*ids[2:], eos], "", finished=True, reason="stop"))
    assert text == tiny_tokenizer.decode(ids, skip_special_tokens=False)  # the stop token itself left out
    assert "<|im_start|>" in text
    keep_stop = TextShaper(tiny_tokenizer, stop=(), stop_ids=frozenset({eos}), keep_special=True, include_stop=True)
    assert keep_stop.feed(chunk([*ids, eos], "", finished=True, reason="stop")) == tiny_tokenizer.decode(
        [*ids, eos], skip_special_tokens=False)


def test_stop_string_put_back_and_echo(tiny_tokenizer):
    ids = tiny_tokenizer.encode("def f(x): return x")
    full = tiny_tokenizer.decode(ids)
    cut = full[: full.index("return")]
    shaper = TextShaper(tiny_tokenizer, stop=("zzz", "return"), stop_ids=frozenset(), include_stop=True,
                        prefix="PROMPT")
    assert shaper.feed(chunk(ids[:1], full[:1])) == "PROMPT" + full[:1]
    assert shaper.feed(chunk(ids[1:], cut[1:], finished=True, reason="stop")) == cut[1:] + "return"
    plain = TextShaper(tiny_tokenizer, stop=("return",), stop_ids=frozenset())
    assert plain.feed(chunk(ids, cut, finished=True, reason="stop")) == cut


@pytest.mark.parametrize("path", ["/flush_cache", "/reset_prefix_cache"])
def test_reset_routes_are_admin_routes(engine, path):
    keyed = SyncClient(create_app(engine, access=AccessPolicy(api_key="u", admin_api_key="a", loopback_only=False)))
    assert keyed.post(path, headers={"authorization": "Bearer u"}).status_code == 403
    assert keyed.post(path).status_code == 401
    assert keyed.post(path, headers={"authorization": "Bearer a"}).status_code == 200
    open_exposed = SyncClient(create_app(engine, access=AccessPolicy(loopback_only=False)))
    assert open_exposed.post(path).status_code == 403  # no admin key on an exposed server: refused


def test_model_card_by_id_over_asgi(client):
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    r = client.get("/v1/models/org/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
