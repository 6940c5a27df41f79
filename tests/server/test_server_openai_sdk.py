"""A real ``python -m ddtree.server`` on loopback driven by the official ``openai`` SDK through every field the
field's clients send: batched prompts, ``n``, echo, stop-string inclusion, special tokens, explicit nulls, log-probs
(completions, echo, chat, streamed), ``min_tokens``, the refusals (out-of-range log-probs), the model card,
tokenization, the statistics reset and the metrics.

References are independent of the code under test: the same server's answer to each prompt alone, a sampled
choice against the request with that choice's seed, the tiny tokenizer itself, the target's own full forward (for
log-probs), and the Prometheus text parser.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import healthy_server

pytestmark = pytest.mark.slow  # the server process takes a few seconds to import torch and load

FLAGS = ["--device", "cpu", "--max-batch", "8", "--max-len", "256", "--max-budget", "16", "--max-queue", "64",
         "--budget", "4", "--topk", "2", "--log-level", "warning"]
PROMPT = "hello world"
GREEDY = {"temperature": 0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Sort a list in Python."}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with healthy_server(tiny_model_dirs, FLAGS, tmp_path_factory.mktemp("sdk")) as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def alone(sdk, prompt, **kwargs) -> str:
    return sdk.completions.create(model="target", prompt=prompt, **{**GREEDY, **kwargs}).choices[0].text


def extra(obj) -> dict:
    """The fields the SDK's models do not declare (meta_info, ddtree, metrics), as sent."""
    return obj.model_extra or {}


# --------------------------------------------------------------------------------------------- completions


def test_batched_prompts_are_choices_in_order(sdk):
    prompts = [PROMPT, "class A:", "def f(x):"]
    r = sdk.completions.create(model="target", prompt=prompts, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [alone(sdk, p) for p in prompts]
    assert r.usage.completion_tokens == 30
    single = [sdk.completions.create(model="target", prompt=p, **GREEDY).usage.prompt_tokens for p in prompts]
    assert r.usage.prompt_tokens == sum(single)
    for c in r.choices:  # per-choice statistics; the top-level ones are for one-choice answers only
        assert extra(c)["meta_info"]["completion_tokens"] == 10 and "ddtree" in extra(c)
    assert "metrics" not in extra(r) and "meta_info" not in extra(r)


def test_token_id_prompts_one_or_a_batch(sdk, server):
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p, "add_special_tokens": False}).json()["tokens"]
           for p in (PROMPT, "class A:")]
    one = sdk.completions.create(model="target", prompt=ids[0], **GREEDY)
    assert one.choices[0].text == alone(sdk, PROMPT)
    batch = sdk.completions.create(model="target", prompt=ids, **GREEDY)
    assert [c.text for c in batch.choices] == [alone(sdk, PROMPT), alone(sdk, "class A:")]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_greedy_n_copies_and_sampled_n_has_derived_seeds(sdk):
    r = sdk.completions.create(model="target", prompt=PROMPT, n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.text for c in r.choices} == {alone(sdk, PROMPT)}
    assert r.usage.completion_tokens == 30  # every copy counts, as vLLM reports it

    sampled = {"temperature": 1.0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    r = sdk.completions.create(model="target", prompt=[PROMPT, "x = "], n=2, seed=11, **sampled)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate([PROMPT, "x = "]):
        for j in range(2):  # choice (i, j) is the request for prompt i alone with seed + j
            ref = sdk.completions.create(model="target", prompt=prompt, seed=11 + j, **sampled).choices[0].text
            assert r.choices[i * 2 + j].text == ref


def test_echo_include_stop_and_special_tokens(sdk):
    text = alone(sdk, PROMPT, max_tokens=12)
    assert alone(sdk, PROMPT, max_tokens=12, echo=True) == PROMPT + text
    stop = text[3:5]
    cut = text[: text.index(stop)]
    assert alone(sdk, PROMPT, max_tokens=12, stop=[stop]) == cut
    kept = sdk.completions.create(model="target", prompt=PROMPT, stop=[stop], temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"
    # The tiny pair emits no special token for this prompt: both settings give the same text, and keeping
    # special tokens is served (TextShaper's own test covers a text that has them).
    for skip in (True, False):
        assert alone(sdk, PROMPT, max_tokens=12, extra_body={"ignore_eos": True, "skip_special_tokens": skip}) == text


def test_min_tokens_holds_stop_strings_and_eos_back(sdk):
    """min_tokens reaches the engine: a stop string inside the first min_tokens tokens does not end the answer
    (streamed or not, completions and chat), and with EOS allowed the answer still has at least min_tokens tokens
    (the engine tests check the masking itself against a full-forward decoder)."""
    text = alone(sdk, PROMPT, max_tokens=12)
    stop = text[3:5]
    assert alone(sdk, PROMPT, max_tokens=12, stop=[stop]) == text[: text.index(stop)]  # without min_tokens: cut
    held = sdk.completions.create(model="target", prompt=PROMPT, stop=[stop], temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True, "min_tokens": 12})
    assert held.choices[0].text == text and held.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model="target", prompt=PROMPT, stop=[stop], temperature=0, max_tokens=12, stream=True,
        extra_body={"ignore_eos": True, "min_tokens": 12}) if c.choices)
    assert streamed == text
    for prompt in (PROMPT, "x", "def f(x):"):
        r = sdk.completions.create(model="target", prompt=prompt, temperature=0, max_tokens=20,
                                   extra_body={"min_tokens": 9})
        assert r.usage.completion_tokens >= 9
    chat = sdk.chat.completions.create(model="target", messages=MESSAGES, temperature=0, max_tokens=10,
                                       extra_body={"ignore_eos": True})
    content = chat.choices[0].message.content
    held = sdk.chat.completions.create(model="target", messages=MESSAGES, temperature=0, max_tokens=10,
                                       stop=[content[2:4]], extra_body={"ignore_eos": True, "min_tokens": 10})
    assert held.choices[0].message.content == content and held.usage.completion_tokens == 10


def test_explicit_nulls_mean_defaults(sdk):
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "n", "stream", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "stop", "seed", "stream_options",
                               "min_tokens", "min_p", "logit_bias", "best_of", "logprobs", "echo", "suffix",
                               "include_stop_str_in_output", "skip_special_tokens", "user")}
    r = sdk.completions.create(model="target", prompt=PROMPT, max_tokens=None,
                               extra_body={**nulls, "ignore_eos": True})
    assert r.usage.completion_tokens == 16 and len(r.choices) == 1  # completions' default max_tokens
    c = sdk.chat.completions.create(model="target", messages=MESSAGES, max_tokens=5,
                                    extra_body={**nulls, "ignore_eos": True, "max_completion_tokens": None,
                                                "tools": None, "tool_choice": None, "top_logprobs": None})
    assert c.usage.completion_tokens == 5


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": -1}, "logprobs"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"),  # above max_tokens (4)
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"best_of": 3}, "best_of"),
    ({"extra_body": {"min_p": 0.2}}, "min_p"),
    ({"n": 1000}, "n"),
    ({"extra_body": {"skip_special_tokens": False}, "stop": ["x"]}, "skip_special_tokens"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_unsupported_fields_are_400_naming_them(sdk, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="target", prompt=PROMPT, max_tokens=4, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and param.split("_")[0] in info.value.body["message"]


def test_streamed_batch_with_n_matches_the_plain_answer(sdk):
    prompts = [PROMPT, "class A:"]
    plain = sdk.completions.create(model="target", prompt=prompts, n=2, **GREEDY)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in sdk.completions.create(model="target", prompt=prompts, n=2, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in plain.choices}
    assert finish == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert usage.completion_tokens == plain.usage.completion_tokens == 40
    assert usage.prompt_tokens == plain.usage.prompt_tokens


# ------------------------------------------------------------------------------------------------------ chat


def test_chat_n_streamed_and_not(sdk):
    plain = sdk.chat.completions.create(model="target", messages=MESSAGES, n=2, temperature=0, max_tokens=8,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.choices[0].message.content == plain.choices[1].message.content
    assert plain.usage.completion_tokens == 16
    texts, roles = {}, {}
    for chunk in sdk.chat.completions.create(model="target", messages=MESSAGES, n=2, temperature=0, max_tokens=8,
                                             stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.delta.role:
                roles[c.index] = roles.get(c.index, 0) + 1
    assert texts == {0: plain.choices[0].message.content, 1: plain.choices[1].message.content}
    assert roles == {0: 1, 1: 1}  # the role comes once per choice


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens"),  # above max_tokens (4)
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tool_choice": "required", "extra_body": {}}, "tool_choice"),
], ids=lambda v: str(v) if isinstance(v, str) else None)
def test_chat_unsupported_fields_are_400(sdk, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="target", messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param


# --------------------------------------------------------------------------- statistics shapes and metrics


def test_per_request_stats_in_sglang_and_vllm_shapes(sdk):
    r = sdk.completions.create(model="target", prompt=PROMPT, **GREEDY)
    body = r.model_dump()
    ours, meta = body["ddtree"], body["meta_info"]
    # SGLang counts by accepted drafts: hist[j] = rounds that accepted j drafts = our rounds that committed j + 1.
    depth = min(ours["tree"]["budget"], ours["tree"]["block_size"] - 1)
    expected = [ours["accept_hist"][j + 1] if j + 1 < len(ours["accept_hist"]) else 0 for j in range(depth + 1)]
    assert meta["spec_accept_histogram"] == meta["spec_correct_drafts_histogram"] == expected
    accepted = sum(j * c for j, c in enumerate(expected))
    assert meta["spec_num_correct_drafts"] == accepted and meta["spec_num_proposed_drafts"] == 4 * ours["verify_rounds"]
    assert meta["spec_accept_rate"] == pytest.approx(accepted / (4 * ours["verify_rounds"]))
    spec = body["metrics"]["speculative_decoding"]  # vLLM's shape, what AIPerf reads
    assert spec == {"num_spec_steps": ours["verify_rounds"], "num_spec_tokens": depth,
                    "num_draft_tokens": 4 * ours["verify_rounds"], "num_accepted_draft_tokens": accepted,
                    "draft_acceptance_rate": pytest.approx(meta["spec_accept_rate"]),
                    "mean_acceptance_length": pytest.approx(1 + accepted / ours["verify_rounds"]),
                    "acceptance_histogram": expected}
    # streamed: on the final usage chunk alone, where vLLM puts it (AIPerf keeps a request's stats only when
    # exactly one of its chunks carries them); without include_usage, on the last chunk of the choice
    chunks = list(sdk.completions.create(model="target", prompt=PROMPT, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and extra(chunks[-1])["metrics"]["speculative_decoding"] == spec
    assert [i for i, c in enumerate(chunks) if "metrics" in extra(c)] == [len(chunks) - 1]
    chunks = list(sdk.completions.create(model="target", prompt=PROMPT, stream=True, **GREEDY))
    carrying = [c for c in chunks if "metrics" in extra(c)]
    assert len(carrying) == 1 and carrying[0].choices[0].finish_reason is not None
    assert extra(carrying[0])["metrics"]["speculative_decoding"] == spec


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_counters_and_latency_histograms(sdk, server):
    model = (("model_name", "target"),)
    before = scrape(server)
    answers = [sdk.completions.create(model="target", prompt=p, **GREEDY).model_dump() for p in (PROMPT, "x = 1")]
    ar = sdk.completions.create(model="target", prompt=PROMPT, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "ddtree": {"method": "ar"}}})  # plain decoding proposes no drafts
    assert extra(ar)["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0
    after = scrape(server)

    def delta(name, labels=model):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    specs = [a["metrics"]["speculative_decoding"] for a in answers]
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in specs)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_draft_tokens"] for s in specs)
    for p in range(3):  # position p: rounds that accepted more than p drafts
        labels = tuple(sorted((*model, ("position", str(p)))))
        hists = [s["acceptance_histogram"] for s in specs]
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels) == sum(sum(h[p + 1:]) for h in hists)
    drafts, accepted = after[("vllm:spec_decode_num_draft_tokens_total", model)], \
        after[("vllm:spec_decode_num_accepted_tokens_total", model)]
    assert after[("ddtree:spec_accept_rate", model)] == pytest.approx(accepted / drafts)
    assert delta("ddtree:time_per_output_token_seconds_count") == 3
    assert delta("ddtree:inter_token_latency_seconds_count") >= 3  # at least one gap per request of 10 tokens


# ------------------------------------------------------------------------------------------- other routes


def test_model_card_and_unknown_model(sdk):
    card = sdk.models.retrieve("target")
    assert card.id == "target" and card.owned_by == "ddtree"
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


def test_version_tokenize_detokenize(server, tiny_tokenizer):
    from ddtree import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    r = httpx.post(server.url + "/tokenize", json={"model": "target", "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tiny_tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    rendered = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("route", [("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/reset_prefix_cache")])
def test_stats_reset_routes(sdk, server, route):
    sdk.completions.create(model="target", prompt="warm", **GREEDY)
    r = httpx.request(route[0], server.url + route[1])
    assert r.status_code == 200 and "no prefix cache" in r.json()["prefix_cache"]
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == 0.0 and info["since_reset"]["verify_rounds"] == 0
    assert info["snapshot"]["verify_rounds_total"] > 0  # the engine's own counters are cumulative
    one = sdk.completions.create(model="target", prompt=PROMPT, **GREEDY).model_dump()["meta_info"]
    info = httpx.get(server.url + "/server_info").json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(one["spec_accept_length"])


# ------------------------------------------------------------------------------------------------- log-probs
# The reference is the target itself, loaded in this process (the server loads the same weights from disk): a
# plain full forward over prompt + output and log_softmax, no cache and no trees. The server speculates (DDTree,
# budget 4), so equal log-probs mean they are the target's at the accepted nodes.


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _reference(tiny_pair, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The greedy continuation of ``prompt_ids`` and log_softmax over prompt + continuation (row p: token p+1)."""
    target, _ = tiny_pair
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(target.forward_train(torch.tensor([ids])).logits[0, -1].argmax()))
        logp = torch.log_softmax(target.forward_train(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids[len(prompt_ids):], logp


def _token(tokenizer, i: int) -> str:
    return tokenizer.decode([i], skip_special_tokens=False)


def test_completion_logprobs_are_the_targets(sdk, tiny_pair, tiny_tokenizer):
    prompt_ids = tiny_tokenizer.encode(PROMPT)
    r = sdk.completions.create(model="target", prompt=PROMPT, logprobs=3, **GREEDY)
    out, logp = _reference(tiny_pair, prompt_ids, 10)
    lp = r.choices[0].logprobs
    assert lp.tokens == [_token(tiny_tokenizer, i) for i in out]
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    start = len(prompt_ids) - 1
    for j, tok in enumerate(out):
        row = logp[start + j]
        assert _close(lp.token_logprobs[j], float(row[tok]))
        top = torch.topk(row, 3)
        expected = {_token(tiny_tokenizer, int(i)): float(v) for v, i in zip(top.values, top.indices, strict=True)}
        assert set(lp.top_logprobs[j]) == set(expected)  # greedy: the chosen token is the most probable one
        assert all(_close(lp.top_logprobs[j][k], v) for k, v in expected.items())


def test_echo_with_logprobs_scores_the_prompt_first_token_null(sdk, tiny_pair, tiny_tokenizer):
    prompt = "def add(a, b):\n    return"
    prompt_ids = tiny_tokenizer.encode(prompt)
    r = sdk.completions.create(model="target", prompt=prompt, echo=True, logprobs=1, **{**GREEDY, "max_tokens": 4})
    out, logp = _reference(tiny_pair, prompt_ids, 4)
    lp = r.choices[0].logprobs
    ids = prompt_ids + out
    assert r.choices[0].text.startswith(prompt)
    assert lp.tokens == [_token(tiny_tokenizer, i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert _close(lp.token_logprobs[p], float(logp[p - 1, ids[p]])), p
        best = int(logp[p - 1].argmax())
        assert _token(tiny_tokenizer, best) in lp.top_logprobs[p]  # the top-1 plus the token itself
        assert _token(tiny_tokenizer, ids[p]) in lp.top_logprobs[p]
    # logprobs: 0 is the chosen token's log-prob alone
    zero = sdk.completions.create(model="target", prompt=PROMPT, logprobs=0, **GREEDY).choices[0].logprobs
    assert all(len(t) == 1 for t in zero.top_logprobs)


def test_streamed_completion_logprobs_equal_the_plain_answer(sdk):
    plain = sdk.completions.create(model="target", prompt=PROMPT, logprobs=2, echo=True, **GREEDY)
    tokens, values, tops, offsets, text = [], [], [], [], ""
    for chunk in sdk.completions.create(model="target", prompt=PROMPT, logprobs=2, echo=True, stream=True, **GREEDY):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    want = plain.choices[0].logprobs
    assert text == plain.choices[0].text
    assert (tokens, values, tops, offsets) == (want.tokens, want.token_logprobs, want.top_logprobs, want.text_offset)


def test_chat_logprobs_and_top_logprobs_streamed_and_not(sdk, tiny_pair, tiny_tokenizer):
    r = sdk.chat.completions.create(model="target", messages=MESSAGES, logprobs=True, top_logprobs=2, temperature=0,
                                    max_tokens=6, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    prompt_ids = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    assert r.usage.prompt_tokens == len(prompt_ids)
    out, logp = _reference(tiny_pair, prompt_ids, 6)
    for j, (c, tok) in enumerate(zip(content, out, strict=True)):
        row = logp[len(prompt_ids) - 1 + j]
        assert c.token == _token(tiny_tokenizer, tok) and c.bytes == list(c.token.encode("utf-8"))
        assert _close(c.logprob, float(row[tok]))
        top = torch.topk(row, 2)
        assert [t.token for t in c.top_logprobs] == [_token(tiny_tokenizer, int(i)) for i in top.indices]
        assert all(_close(t.logprob, float(v)) for t, v in zip(c.top_logprobs, top.values, strict=True))
    streamed = []
    for chunk in sdk.chat.completions.create(model="target", messages=MESSAGES, logprobs=True, top_logprobs=2,
                                             temperature=0, max_tokens=6, stream=True,
                                             extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [s.model_dump() for s in streamed] == [c.model_dump() for c in content]
    # without logprobs nothing is computed or sent
    plain = sdk.chat.completions.create(model="target", messages=MESSAGES, temperature=0, max_tokens=3)
    assert plain.choices[0].logprobs is None
