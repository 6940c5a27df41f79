"""The engine with CUDA graphs (rounds and whole-prompt prefills) decodes exactly like the same engine without them.

GPU only: graphs need a CUDA device. fp32 on the shipped demo pair, so both engines run the same kernels in the
same order and must give the same tokens. The requests mix budgets 4 and 8 and greedy and sampled rows, so graph
keys share their draft and tree stages (``cuda_graphs.RoundGraphs``: one draft graph per rows, block and length,
one tree graph per node bucket) and a wrong share shows as a different token; budget auto rounds (their result
carries the accepted paths and expected lengths) must give AR's tokens.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.assets import demo_drafter_path, demo_target_path
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.models import load_drafter, load_target, load_tokenizer

pytestmark = pytest.mark.gpu

PROMPTS = ("import os\n\ndef walk(path):\n", "class Stack:\n    def __init__(self):\n",
           "def fib(n):\n    " + "a, b = b, a + b\n    " * 40)


def _decode(graphs: bool) -> tuple[list[list[int]], Engine]:
    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.float32, device="cuda")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.float32, device="cuda")
    # prefill_chunk 128: the long prompt is chunked (eager), the short ones prefill whole (graphed)
    # mixed rounds off: they run eagerly in both engines (tests/engine/test_mixed_rounds.py has their GPU test)
    config = EngineConfig(device="cuda", dtype="float32", max_batch=4, max_len=512, max_budget=16, prefill_chunk=128,
                          cuda_graphs=graphs, mixed_chunk=0)
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name="demo")
    engine.start()
    try:
        requests = [GenerationRequest(prompt_token_ids=tokenizer.encode(p, add_special_tokens=False),
                                      tree=TreeSettings(method=method, budget=8),
                                      sampling=SamplingParams(max_tokens=24, ignore_eos=True))
                    for p in PROMPTS for method in ("ddtree", "ar")]
        outputs = engine.generate(requests)
        # one at a time: each budget and sampling variant in a round of its own rows bucket
        for budget, temperature in ((4, 0.0), (8, 0.8), (4, 0.8)):
            for p in PROMPTS[:2]:
                outputs += engine.generate([GenerationRequest(
                    prompt_token_ids=tokenizer.encode(p, add_special_tokens=False),
                    tree=TreeSettings(method="ddtree", budget=budget),
                    sampling=SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=7))])
        # budget auto: its rounds append each row's accepted path and expected lengths to the graphed result (and
        # measure their cost curve on the graphs first)
        outputs += engine.generate([GenerationRequest(
            prompt_token_ids=tokenizer.encode(p, add_special_tokens=False), tree=TreeSettings(budget="auto"),
            sampling=SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS[:2]])
    finally:
        engine.shutdown()
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs], engine


def test_graphed_rounds_and_prefills_equal_eager():
    eager, _ = _decode(False)
    graphed, engine = _decode(True)
    assert engine.prefill_graphs.captures > 0 and engine.graphs.captures > 0
    assert graphed == eager
    assert graphed[0:6:2] == graphed[1:6:2]  # DDTree == AR, prompt by prompt
    assert graphed[6:8] == graphed[0:4:2][:2]  # greedy budget 4 == greedy budget 8 (== AR)
    assert graphed[12:14] == graphed[1:4:2]  # greedy auto == AR
    stages = engine.graphs.stage_graphs()
    assert stages["forward"] < stages["choose"] or stages["draft"] < stages["forward"], stages  # something shared
