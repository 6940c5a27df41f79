"""After the start-up warm-up, a mixed workload inside the plan captures no graph and compiles no Triton kernel.

Prompts longer than ``prefill_chunk`` continue in eager chunks. On the H200 run of 2026-12-01 (commit 53819c4) these
compiled 5 tree-attention variants after the warm-up (their row count, width and key length were not bucketed, and
the warm-up's eager chunks were one row, full width, at chunk multiples). The scheduler now pads an eager chunk's
width to a multiple of 16 and buckets its key length, and the plan runs one eager chunk per tree-attention variant
such chunks can launch (``ddtree.engine.warmup.eager_chunks``): the long-prompt case must compile nothing too.

GPU only (the plan is empty without CUDA graphs). The demo pair in bf16; the counts come from the engine's own
report (``Engine.info()["warmup"]["misses"]``), cross-checked with the graph sets' capture counters and an
independent Triton compilation listener installed before the engine (``ddtree.lab.bench.matrix.CompileLog``, the
one ``benchmarks/gpu.py`` uses).
"""

from __future__ import annotations

import time

import pytest
import torch

from ddtree.assets import demo_drafter_path, demo_target_path
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.models import load_drafter, load_target, load_tokenizer

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("longest", [
    128,  # every prompt prefills whole (graphed); decode rounds only from the plan
    300,  # the longer prompts continue in eager chunks of any row count, width and start
])
def test_mixed_workload_after_warm_up_captures_and_compiles_nothing(longest):
    from ddtree.lab.bench.matrix import CompileLog

    compiles = CompileLog()
    listening = compiles.install()
    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.bfloat16, device="cuda")
    drafter = load_drafter(demo_drafter_path(), dtype=torch.bfloat16, device="cuda")
    # declared budgets 4 on top of fast (AR + the default b8); prompts up to 300 tokens: the chunked ones' later
    # chunks run eagerly, beside other rows, at widths and key lengths the plan's eager chunks cover
    config = EngineConfig(max_batch=4, max_len=512, max_budget=16, prefill_chunk=128, warmup="4",
                          default_tree=TreeSettings(budget=8))
    engine = Engine(target, drafter, tokenizer, config, model_name="demo")
    try:
        engine.start()
        info = engine.info()["warmup"]
        assert info["state"] == "done" and info["graphs_done"] == info["graphs_planned"] > 0 and not info["dropped"]
        captures = engine.graphs.captures + engine.prefill_graphs.captures
        t_after = time.perf_counter()
        lengths = (5, 40, 128, 17, 90) + ((200, longest) if longest > 128 else (100, 60))
        prompts = [[5 + (i * 13 + j) % 4000 for j in range(n)] for i, n in enumerate(lengths)]
        trees = [TreeSettings(budget=8), TreeSettings(budget=4), TreeSettings(method="ar")]
        requests = [GenerationRequest(prompt_token_ids=p, tree=trees[i % 3],
                                      sampling=SamplingParams(max_tokens=40 + 7 * i, ignore_eos=True))
                    for i, p in enumerate(prompts * 2)]
        outputs = engine.generate(requests, max_in_flight=3)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        outputs = engine.generate(requests[:4])  # a batch of four at once: the rows bucket 4 and its drain
        assert all(o.error is None for o in outputs)
        after = engine.info()["warmup"]["misses"]
        assert after == {"round_graphs": 0, "prefill_graphs": 0, "mixed_graphs": 0, "triton_compiles": 0}, after
        assert engine.graphs.captures + engine.prefill_graphs.captures == captures
        if listening:
            assert compiles.between(t_after, time.perf_counter())["count"] == 0
    finally:
        engine.shutdown()
        compiles.uninstall()
