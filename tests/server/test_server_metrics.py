"""/metrics parses as Prometheus text and its numbers move with the requests that complete."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(client) -> dict[tuple[str, tuple], float]:
    """Every sample as ``(name, sorted labels) -> value``, parsed by prometheus_client's own text parser."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    """The sample of ``name`` with ``labels`` (every family carries the served model's ``model_name`` label)."""
    return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def _has(samples, name: str, **labels) -> bool:
    return (name, tuple(sorted({"model_name": "tiny", **labels}.items()))) in samples


def test_counters_move_with_completed_requests(client, engine):
    before = scrape(client)
    answers = [
        client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": n, "temperature": 0,
                                             "ignore_eos": True, "ddtree": {"budget": 4}}).json()
        for n in (5, 9)
    ]
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 0})  # refused: invalid
    client.post("/v1/completions", json={"prompt": "hello", "model": "nope"})  # refused: not found
    after = scrape(client)

    def delta(name, **labels):  # a labelled histogram has no samples before its first observation
        return value(after, name, **labels) - (value(before, name, **labels) if (name, labels) and
                                                  _has(before, name, **labels) else 0.0)

    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    rounds = sum(a["meta_info"]["spec_verify_ct"] for a in answers)
    assert completion == 14
    assert delta("ddtree:requests_total", outcome="length") == 2
    assert delta("ddtree:requests_total", outcome="invalid") == 1
    assert delta("ddtree:requests_total", outcome="not_found") == 1
    assert delta("ddtree:requests_total", outcome="stop") == 0
    assert delta("ddtree:generation_tokens_total") == completion
    assert delta("ddtree:prompt_tokens_total") == prompt
    assert delta("ddtree:spec_verify_calls_total") == rounds
    # The acceptance histogram counts rounds; its sum counts the tokens those rounds committed.
    assert delta("ddtree:spec_accept_length_per_round_count") == rounds
    hist = [0] * 40
    for a in answers:
        for k, c in enumerate(a["ddtree"]["accept_hist"]):
            hist[k] += c
    assert delta("ddtree:spec_accept_length_per_round_sum") == sum(k * c for k, c in enumerate(hist))
    assert delta("ddtree:spec_accept_length_per_round_bucket", le="1.0") == hist[0] + hist[1]
    assert delta("ddtree:spec_accept_length_per_round_bucket", le="+Inf") == rounds
    for k in range(1, 33):  # every bucket: the rounds that committed at most k tokens
        assert delta("ddtree:spec_accept_length_per_round_bucket", le=f"{float(k)}") == sum(hist[:k + 1])
    assert delta("ddtree:time_to_first_token_seconds_count") == 2
    assert delta("ddtree:e2e_request_latency_seconds_count") == 2
    assert delta("ddtree:stage_seconds_total", stage="verify") > 0


def buckets(samples, name: str) -> list[str]:
    return sorted(dict(labels)["le"] for n, labels in samples if n == name + "_bucket")


def test_histogram_buckets_are_the_same_in_every_scrape(client):
    """A fresh server and one that has committed rounds of several lengths list the same buckets (Prometheus and
    AIPerf read a histogram's schema once; buckets that appear later were ignored)."""
    name = "ddtree:spec_accept_length_per_round"
    fresh = scrape(client)
    answer = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True, "ddtree": {"budget": 8}}).json()
    assert max(k for k, c in enumerate(answer["ddtree"]["accept_hist"]) if c) >= 1
    assert buckets(scrape(client), name) == buckets(fresh, name) == sorted([*(f"{float(k)}" for k in range(1, 33)),
                                                                            "+Inf"])


def test_gauges_describe_the_engine(client, engine):
    samples = scrape(client)
    assert value(samples, "ddtree:num_running_reqs") == 0
    assert value(samples, "ddtree:num_queue_reqs") == 0
    assert value(samples, "ddtree:max_running_reqs") == engine.config.max_batch
    assert value(samples, "ddtree:kv_tokens_capacity") == engine.config.max_batch * engine.config.max_len
    assert value(samples, "ddtree:kv_tokens_used") == 0 and value(samples, "ddtree:token_usage") == 0
    assert value(samples, "ddtree:spec_accept_length") == 0  # a fresh engine (its warm-up is not counted)
    answers = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 7, "temperature": 0}).json()
               for p in ("hello world", "class A:")]
    # Like SGLang: completion tokens over verify rounds, pooled over the requests so far.
    expected = sum(a["usage"]["completion_tokens"] for a in answers) / sum(a["meta_info"]["spec_verify_ct"]
                                                                         for a in answers)
    assert value(scrape(client), "ddtree:spec_accept_length") == expected
    assert client.get("/server_info").json()["internal_states"][0]["avg_spec_accept_length"] == expected


def test_each_app_has_its_own_registry(engine):
    from server_helpers import SyncClient

    from ddtree.server.app import create_app

    first, second = SyncClient(create_app(engine)), SyncClient(create_app(engine))
    first.post("/v1/completions", json={"prompt": "hello", "max_tokens": 0})
    assert value(scrape(first), "ddtree:requests_total", outcome="invalid") == 1
    assert value(scrape(second), "ddtree:requests_total", outcome="invalid") == 0
