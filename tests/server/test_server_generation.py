"""Completions and chat, streamed and not, against the engine's own output for the same settings."""

from __future__ import annotations

import pytest
from server_helpers import DONE, SyncClient, parse_sse

from ddtree.engine.api import GenerationRequest, SamplingParams, TreeSettings
from ddtree.server.app import create_app

PROMPT = "hello world"  # the tiny random pair answers it with printable text (many prompts give raw bytes)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list in Python."}]


def engine_output(engine, *, prompt=None, ids=None, max_tokens=24, tree=None, **sampling):
    sampling = {"temperature": 0.0, **sampling}
    request = GenerationRequest(prompt=prompt, prompt_token_ids=ids, tree=tree,
                                sampling=SamplingParams(max_tokens=max_tokens, **sampling))
    (out,) = engine.generate([request])
    return out


def streamed(response) -> tuple[list, str]:
    """Events of an SSE response and the concatenated text of its content chunks."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == DONE and DONE not in events[:-1]
    text = ""
    for event in events[:-1]:
        for choice in event["choices"]:
            text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
    return events, text


def test_completion_matches_engine_generate(client, engine):
    tree = {"method": "ddtree", "budget": 6, "topk": 3}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ddtree": tree}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    ref = engine_output(engine, prompt=PROMPT, tree=TreeSettings(**tree))
    (choice,) = data["choices"]
    assert data["object"] == "text_completion" and data["model"] == "tiny" and data["id"].startswith("cmpl-")
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert data["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": len(ref.token_ids),
                             "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
    stats = data["ddtree"]
    assert stats["tree"] == {**tree, "block_size": 8, "draft_window": None}
    assert sum(stats["accept_hist"]) == stats["verify_rounds"] > 0
    # SGLang's names, on the choice and at the top level, agree with our statistics and with usage.
    for meta in (choice["meta_info"], data["meta_info"]):
        assert meta["spec_verify_ct"] == stats["verify_rounds"]
        assert meta["spec_accept_length"] == pytest.approx(len(ref.token_ids) / stats["verify_rounds"])
        assert meta["completion_tokens"] == len(ref.token_ids)
        assert meta["finish_reason"] == {"type": ref.finish_reason}


def test_token_id_prompt_equals_text_prompt(client, engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    by_text = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}).json()
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_completions_default_to_16_tokens(client):
    data = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True}).json()
    assert data["usage"]["completion_tokens"] == 16
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("options", [{}, {"include_usage": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
def test_completion_stream_matches_non_stream(client, options):
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ddtree": {"budget": 4}}
    whole = client.post("/v1/completions", json=body).json()
    events, text = streamed(client.post("/v1/completions", json={**body, "stream": True, "stream_options": options}))
    assert text == whole["choices"][0]["text"]
    chunks = events[:-1]
    if options.get("include_usage"):
        *chunks, usage_chunk = chunks
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    if options.get("continuous_usage_stats"):
        # Cumulative usage on every chunk: it grows with the text and ends at the response's usage.
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[0] >= 1 and chunks[-1]["usage"] == whole["usage"]
        assert all(c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for c in chunks)
    elif options.get("include_usage"):
        assert all(c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c for c in chunks)
    assert len(chunks) >= 2, "a 20-token answer should arrive in several chunks"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    # Only the last content chunk carries the finish reason and the statistics.
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[:-1] == [None] * (len(chunks) - 1) and reasons[-1] == whole["choices"][0]["finish_reason"]
    last = chunks[-1]
    assert last["choices"][0]["meta_info"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert last["ddtree"]["tree"] == whole["ddtree"]["tree"]


def test_chat_uses_the_tokenizer_chat_template(client, engine, tiny_tokenizer):
    # The reference prompt comes from Hugging Face's own template rendering, not from the engine's helper.
    ids = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = engine_output(engine, ids=ids, max_tokens=16)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    (choice,) = data["choices"]
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert choice["finish_reason"] == ref.finish_reason
    assert data["usage"]["prompt_tokens"] == len(ids) and data["usage"]["completion_tokens"] == len(ref.token_ids)
    assert choice["meta_info"]["spec_verify_ct"] == data["ddtree"]["verify_rounds"]


def test_chat_text_parts_and_max_completion_tokens(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort a list "}, {"type": "text", "text": "in Python."}]}]
    plain = [{"role": "user", "content": "Sort a list in Python."}]
    a = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 7, "max_tokens": 50,
                                                  "temperature": 0, "ignore_eos": True}).json()
    b = client.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 7, "temperature": 0,
                                                  "ignore_eos": True}).json()
    assert a["usage"]["completion_tokens"] == 7  # max_completion_tokens wins over max_tokens
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_chat_stream(client):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=body).json()
    events, text = streamed(client.post("/v1/chat/completions", json={**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}}))
    assert text == whole["choices"][0]["message"]["content"]
    *chunks, usage_chunk, _ = events
    assert usage_chunk["usage"] == whole["usage"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + [usage_chunk])
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_chat_without_max_tokens_fills_the_context(tiny_engine_factory, tiny_tokenizer):
    engine = tiny_engine_factory(max_batch=2, max_len=48, max_budget=16)
    client = SyncClient(create_app(engine))
    ids = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    data = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "ignore_eos": True}).json()
    assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 48 - len(ids), "total_tokens": 48}
    assert data["choices"][0]["finish_reason"] == "length"


def test_greedy_output_is_the_same_for_every_method(client):
    """Lossless decoding through the server: AR, the DFlash chain and trees of any budget agree token for token."""
    texts, rounds = {}, {}
    for tree in ({"method": "ar"}, {"method": "dflash"}, {"method": "ddtree", "budget": 2},
                 {"method": "ddtree", "budget": 16, "topk": 4}):
        data = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                    "ignore_eos": True, "ddtree": tree}).json()
        key = str(tree)
        texts[key], rounds[key] = data["choices"][0]["text"], data["meta_info"]["spec_verify_ct"]
        assert data["ddtree"]["tree"]["method"] == tree["method"]
    assert len(set(texts.values())) == 1
    # AR commits one token per round after the prefill's first token.
    assert rounds[str({"method": "ar"})] == 23


def test_stop_string_trims_the_answer(client):
    base = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True}).json()["choices"][0]["text"]
    stop = base[6:9]
    assert len(stop) == 3
    data = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True, "stop": [stop]}).json()
    assert data["choices"][0]["text"] == base[: base.index(stop)]
    assert data["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats_and_seeds_differ(client):
    def sample(seed: int) -> str:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "top_k": -1, "seed": seed, "ignore_eos": True}
        return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_models_and_health(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [engine.model_name]
    assert models["data"][0]["max_model_len"] == engine.config.max_len


def test_server_info_reports_config_and_acceptance(client, engine):
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    info = client.get("/server_info").json()
    assert info["model"] == engine.model_name
    assert info["engine"]["limits"]["max_batch"] == engine.config.max_batch
    assert info["engine"]["kv_cache"]["capacity_tokens"] == info["snapshot"]["kv_tokens_capacity"]
    assert info["server"]["rss_bytes"] > 10 * 2**20
    assert info["snapshot"]["generation_tokens_total"] == 8
