"""budget "auto" through a real ``ddtree serve`` process and the official ``openai`` client: accepted per request
and as the server default, a wrong string refused with a 400 naming the field, the chosen sizes in the response's
statistics and in the ``ddtree:auto_budget_chosen`` histogram (read with the Prometheus text parser).

References: the server's own greedy answer with a fixed budget (auto must not change a token), the response's
round count (every round of an auto request chose one size), and the histogram's count against the sum of them.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import healthy_server

pytestmark = pytest.mark.slow  # the server process takes a few seconds to import torch and load

FLAGS = ["--device", "cpu", "--max-batch", "4", "--max-len", "256", "--max-budget", "16", "--max-queue", "16",
         "--log-level", "warning"]
GREEDY = {"temperature": 0, "max_tokens": 24}
PROMPTS = ["def f(x):", "class A:\n    def"]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _histogram(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "ddtree:auto_budget_chosen":
            return {s.name.removeprefix("ddtree:auto_budget_chosen") + s.labels.get("le", ""): s.value
                    for s in family.samples}
    raise AssertionError("ddtree:auto_budget_chosen is not exported")


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    with healthy_server(tiny_model_dirs, [*FLAGS, "--budget", "4"], tmp_path_factory.mktemp("auto")) as proc:
        yield proc


def test_auto_per_request_keeps_the_tokens_and_reports_the_sizes(server):
    before = _histogram(server).get("_count", 0.0)
    rounds = 0
    with _client(server) as sdk:
        for prompt in PROMPTS:
            fixed = sdk.completions.create(model="target", prompt=prompt, **GREEDY,
                                           extra_body={"ignore_eos": True, "ddtree": {"budget": 8}})
            auto = sdk.completions.create(model="target", prompt=prompt, **GREEDY,
                                          extra_body={"ignore_eos": True, "ddtree": {"budget": "auto"}})
            assert auto.choices[0].text == fixed.choices[0].text
            spec = auto.model_extra["metrics"]["speculative_decoding"]
            counts = {int(b): n for b, n in spec["auto_budget_counts"].items()}
            assert sum(counts.values()) == spec["num_spec_steps"] > 0
            assert spec["auto_budget_mean"] == pytest.approx(sum(b * n for b, n in counts.items()) / sum(counts.values()))
            assert all(b in (0, 1, 3, 7, 15) for b in counts)  # no tree and the candidates of --max-budget 16
            assert spec["num_draft_tokens"] == sum(b * n for b, n in counts.items())
            assert auto.model_extra["ddtree"]["auto_budgets"] == {str(b): n for b, n in counts.items()}
            assert "auto_budget_counts" not in fixed.model_extra["metrics"]["speculative_decoding"]
            rounds += sum(counts.values())
    assert _histogram(server)["_count"] - before == rounds


@pytest.mark.parametrize("budget", ["best", "16", ""])
def test_a_wrong_budget_string_is_a_400_naming_the_field(server, budget):
    with _client(server) as sdk, pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="target", prompt="x", **GREEDY, extra_body={"ddtree": {"budget": budget}})
    assert info.value.status_code == 400
    assert info.value.body["param"] == "ddtree.budget"
    assert '"auto"' in info.value.body["message"] and repr(budget) in info.value.body["message"]
    with _client(server) as sdk:  # the engine loop is unharmed
        assert sdk.completions.create(model="target", prompt="x", **GREEDY).choices[0].text is not None


def test_serve_budget_auto_is_the_default_tree(tiny_model_dirs, tmp_path_factory, server):
    with healthy_server(tiny_model_dirs, [*FLAGS, "--budget", "auto"], tmp_path_factory.mktemp("auto_default")) as proc:
        info = httpx.get(proc.url + "/server_info").json()
        with _client(proc) as sdk:
            r = sdk.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], **GREEDY)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert sum(spec["auto_budget_counts"].values()) == spec["num_spec_steps"] > 0
    assert info["default_tree"]["budget"] == "auto"
