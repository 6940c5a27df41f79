"""Exact mode (EngineConfig.exact): greedy chains and trees give exactly AR's tokens, alone and in mixed batches.

Reference: the same engine's AR decoding (and, in fp32, the plain full-recompute decoder). Run in bf16, where the
rounding differences exact mode removes exist, on the CPU through the one-row-at-a-time torch path, with the oracle
drafter so that trees accept deep paths and siblings. (On this CPU the default bf16 path happens to be row-invariant
for the tiny pair too, so these tests guard exact mode's own path: a wrong ancestor, position or split breaks them;
the divergence exact mode removes shows on the GPU, docs/benchmarks.md "Exact mode".)
"""

from __future__ import annotations

import copy

import pytest
import torch

from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.errors import ConfigError

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self", "x"]
SETTINGS = [
    TreeSettings(method="dflash"),
    TreeSettings(method="ddtree", budget=4, topk=2),
    TreeSettings(method="ddtree", budget=16),
    TreeSettings(method="ddtree", budget=32, topk=4, block_size=6),
]
N = 24


@pytest.fixture(scope="module")
def exact_engine(request, tiny_pair, tiny_tokenizer):
    # tests/conftest.py's OracleDrafter (found among the loaded conftests: ``import conftest`` would name whichever
    # directory's conftest was imported last)
    oracle_cls = next(p.OracleDrafter for p in request.config.pluginmanager.get_plugins() if hasattr(p, "OracleDrafter"))
    target, drafter = (copy.deepcopy(m).to(torch.bfloat16) for m in tiny_pair)
    oracle = oracle_cls(drafter, target, noise=2.0)
    # mixed rounds on (EngineConfig.mixed_chunk): staggered arrivals ride in rounds (the last test)
    engine = Engine(target, oracle, tiny_tokenizer, EngineConfig(max_batch=8, max_len=256, max_budget=32, exact=True,
                                                                 mixed_chunk=32), model_name="tiny")
    oracle.attach(engine)
    engine.start()
    yield engine
    engine.shutdown(drain_timeout=0)


def _req(prompt, tree):
    return GenerationRequest(prompt=prompt, tree=tree, sampling=SamplingParams(max_tokens=N, ignore_eos=True))


def test_exact_mode_is_resolved_into_the_kernel_set(exact_engine):
    kernels = exact_engine.runner.kernels
    assert kernels.exact and kernels.tree_attention  # the verify hands the target its tree visibility
    assert exact_engine.info()["config"]["exact"] is True


def test_chains_and_trees_equal_ar_alone_and_mixed(exact_engine):
    ar = {p: exact_engine.generate([_req(p, TreeSettings(method="ar"))])[0].token_ids for p in PROMPTS}
    accepted = []
    for tree in SETTINGS:  # one request at a time
        for p in PROMPTS:
            out = exact_engine.generate([_req(p, tree)])[0]
            assert out.token_ids == ar[p], f"{tree} differs from AR on {p!r}"
            accepted.append(out.stats.accept_length)
    assert max(accepted) > 2  # the trees really accepted several tokens a round
    # mixed batches: every setting and AR beside each other, prompts of different lengths
    mixed = [_req(p, tree) for tree in [TreeSettings(method="ar"), *SETTINGS] for p in PROMPTS]
    for req, out in zip(mixed, exact_engine.generate(mixed), strict=True):
        assert out.token_ids == ar[req.prompt], f"{req.tree} in a mixed batch differs from AR on {req.prompt!r}"


def test_exact_fp32_matches_the_plain_decoder(tiny_engine_factory, tiny_pair, tiny_tokenizer):
    target, _ = tiny_pair
    engine = tiny_engine_factory(oracle=True, exact=True, max_len=256)
    ids = tiny_tokenizer.encode(PROMPTS[0])
    ref = []
    with torch.inference_mode():
        for _ in range(N):
            ref.append(int(target.forward_train(torch.tensor([ids + ref])).logits[0, -1].argmax()))
    out = engine.generate([_req(PROMPTS[0], TreeSettings(method="ddtree", budget=16))])[0]
    assert out.token_ids == ref


def test_exact_must_be_a_bool():
    with pytest.raises(ConfigError, match="exact must be true or false"):
        EngineConfig(exact="yes").validated()


def test_prompts_written_inside_decode_rounds_give_ar_bits(exact_engine):
    """Mixed rounds in exact mode: a newcomer's prompt chunk rides in the verify forward of the requests already
    decoding (EngineConfig.mixed_chunk), and every request still equals AR alone bit for bit (the chunk's K/V and
    first-token logits are computed as a prefill step computes them)."""
    from engine_helpers import submit_staggered

    ar = {p: exact_engine.generate([_req(p, TreeSettings(method="ar"))])[0].token_ids for p in PROMPTS}
    before = exact_engine.snapshot().mixed_rounds_total
    reqs = [_req(p, tree) for tree, p in zip(SETTINGS[1:] * 2, PROMPTS * 2, strict=False)]
    outs = submit_staggered(exact_engine, reqs, 0.05, timeout=300)
    for out, req in zip(outs, reqs, strict=True):
        assert out == ar[req.prompt], f"{req.tree} with staggered arrivals differs from AR on {req.prompt!r}"
    assert exact_engine.snapshot().mixed_rounds_total > before  # prompts really rode in rounds
