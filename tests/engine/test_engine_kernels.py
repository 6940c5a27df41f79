"""The engine with every Triton kernel on (fused layer ops, tree attention in the verify and the drafter, K/V
stores, vocabulary top-k, node selection, the walk, KV compaction) decodes the shipped demo pair exactly like plain decoding and like the
torch path.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py), so this checks on a CPU the wiring
a GPU runs: ``EngineConfig(gpu_kernels=True)`` resolved into a ``KernelSet`` that reaches the model forwards
(``kernels=``), ``build_trees(fast_topk=True)`` and the verify's ``TreeVisibility`` call. fp32, so every path must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from ddtree import triton_runtime
from ddtree.assets import demo_drafter_path, demo_target_path
from ddtree.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TreeSettings
from ddtree.models import (
    DFlashDrafter,
    fuse_projections,
    load_drafter,
    load_target,
    load_tokenizer,
    tree_attention,
)
from ddtree.speculative import compaction, tree_select, vocab_topk, walk

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(triton_runtime.triton is None, reason="needs Triton"),
    pytest.mark.skipif(not torch.cuda.is_available() and not triton_runtime.INTERPRETED,
                       reason="no CUDA device and Triton's interpreter is off"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REAL = {"topk": (vocab_topk, "topk_logsumexp"), "attention": (tree_attention, "tree_attention"),
        "kv_store": (tree_attention, "write_kv"), "select": (tree_select, "select_nodes"),
        "walk": (walk, "_walk_kernel_launch"), "compaction": (compaction, "_compact_kernel_launch")}
REAL_FUNCTIONS = {name: getattr(module, attr) for name, (module, attr) in REAL.items()}
REAL_KERNEL_ATTEND = DFlashDrafter._kernel_attend
REAL_APPEND_CONTEXT = DFlashDrafter.append_context
PROMPT = "import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n"


def _decode(kernels: bool, monkeypatch) -> tuple[list[list[int]], dict[str, int]]:
    calls = dict.fromkeys(REAL, 0)

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return REAL_FUNCTIONS[name](*args, **kwargs)

        return call

    for name, (module, attr) in REAL.items():
        monkeypatch.setattr(module, attr, counted(name))
    calls["drafter_blocks"] = 0

    def counted_blocks(self, *args, **kwargs):
        calls["drafter_blocks"] += 1
        return REAL_KERNEL_ATTEND(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "_kernel_attend", counted_blocks)
    calls["context_appends"] = 0

    def counted_appends(self, *args, **kwargs):
        calls["context_appends"] += 1
        return REAL_APPEND_CONTEXT(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "append_context", counted_appends)
    tokenizer = load_tokenizer(demo_target_path())
    target = load_target(demo_target_path(), dtype=torch.float32, device=DEVICE)
    drafter = load_drafter(demo_drafter_path(), dtype=torch.float32, device=DEVICE)
    fuse_projections(target)  # the engine does this itself on CUDA only
    fuse_projections(drafter)
    layers = len(drafter.layers)
    config = EngineConfig(device=DEVICE, dtype="float32", max_batch=2, max_len=256, max_budget=16, cuda_graphs=False,
                          gpu_kernels=kernels)
    engine = Engine.from_models(target, drafter, tokenizer, config, model_name="demo")
    engine.start()
    try:
        prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
        requests = [GenerationRequest(prompt_token_ids=prompt, tree=TreeSettings(method=method, budget=8),
                                      sampling=SamplingParams(max_tokens=6, ignore_eos=True))
                    for method in ("ddtree", "ar")]
        outputs = engine.generate(requests)
    finally:
        engine.shutdown()
    assert [o.error for o in outputs] == [None, None]
    calls["drafter_context_writes"] = calls["context_appends"] * layers  # write_kv calls append_context owes
    return [o.token_ids for o in outputs], calls


def test_engine_with_every_kernel_equals_plain_decoding_and_the_torch_path(triton_kernels_on_cpu, monkeypatch):
    reference, reference_calls = _decode(False, monkeypatch)
    tokens, calls = _decode(True, monkeypatch)
    assert {k: v for k, v in reference_calls.items() if k in REAL} == dict.fromkeys(REAL, 0), reference_calls
    assert reference_calls["drafter_blocks"] == 0, reference_calls
    assert min(calls.values()) > 0, calls  # every kernel really ran
    # Each kernel attention stored its new K/V with the kernel, and so did each drafter layer's context append.
    assert calls["kv_store"] == calls["attention"] + calls["drafter_context_writes"], calls
    assert calls["drafter_blocks"] > 0  # the drafter's blocks attended through the kernel too
    assert tokens[0] == tokens[1] == reference[0] == reference[1]
