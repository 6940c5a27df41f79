"""Nothing in a round's ops may sync with the host, checked three ways on CPU (and directly on CUDA).

1. Every aten op of a whole round is recorded by a dispatch mode: reading a value on the host (``.item()``,
   ``int(t)``, ``bool(t)``) always dispatches ``aten._local_scalar_dense``, and the data-dependent-shape ops
   (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) sync on CUDA; none may appear.
2. ``torch.compile(fullgraph=True)`` (``eager`` backend: a tracing check that takes seconds) must capture the round
   as one graph with the eager results, so it can sit inside a captured CUDA graph.
3. The modules' source has no ``.tolist()`` (which bypasses the dispatcher) nor the other calls above.
On CUDA the round also runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ddtree.speculative as spec
from ddtree.speculative import attention, compaction, sampling, tree, walk


def _round(logits, target_logits, budget, topk, depth_limit, root, cache, slots, start, seed, step):
    trees = spec.build_trees(logits, budget, topk, max_budget=8, depth_limit=depth_limit, root_tokens=root)
    write = spec.tree_write_positions(start, 9)
    mask = spec.build_attention_mask(start, write, trees.visibility, cache.shape[3])
    positions = spec.tree_positions(start, trees.depths)
    rows = logits.shape[0]
    dev = logits.device
    temperature = torch.linspace(0.0, 1.0, rows, device=dev)
    choices = spec.sample_choices(target_logits, temperature, torch.full((rows,), 0.9, device=dev),
                                  torch.full((rows,), 3, device=dev),
                                  seed, step.unsqueeze(1) + trees.depths)
    result = spec.walk_trees(trees, choices, logits.shape[1])
    spec.compact_cache(cache, slots, start, result.path)
    chain = spec.build_chain(logits, depth_limit=depth_limit, root_tokens=root, max_budget=8)
    return result, mask, positions, chain, spec.additive_mask(mask, torch.float16)


def _inputs(device: str):
    gen = torch.Generator().manual_seed(0)
    rows, depths, vocab = 3, 4, 11
    args = (
        torch.randn(rows, depths, vocab, generator=gen),
        torch.randn(rows, 9, vocab, generator=gen),
        torch.tensor([8, 2, 0]),
        torch.tensor([0, 1, 3]),
        torch.tensor([4, 2, 3]),
        torch.tensor([1, 2, 3]),
        torch.randn(2, 4, 1, 32, 2, generator=gen),
        torch.tensor([3, 0, 1]),
        torch.tensor([5, 0, 12]),
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 7, 9]),
    )
    return tuple(a.to(device) for a in args)


class HostReadRecorder(TorchDispatchMode):
    """Records aten ops that read tensor values on the host or have data-dependent output shapes."""

    SYNCING = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
               "aten.unique_dim", "aten.unique_consecutive", "aten.is_nonzero", "aten.equal"}

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        bool_index = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in leaves[1:]
        )
        if name in self.SYNCING or bool_index:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def test_a_whole_round_reads_nothing_on_the_host() -> None:
    with HostReadRecorder() as recorder:
        _round(*_inputs("cpu"))
    assert recorder.found == []


def test_recorder_catches_host_reads() -> None:
    x = torch.arange(4.0)
    with HostReadRecorder() as recorder:
        x.sum().item()
        bool(x[0] > 1)
        x[x > 1]
        x.nonzero()
    assert recorder.found == ["aten._local_scalar_dense", "aten._local_scalar_dense", "aten.index", "aten.nonzero"]


def test_a_whole_round_traces_as_one_graph() -> None:
    torch._dynamo.reset()
    eager_args = _inputs("cpu")
    compiled_args = _inputs("cpu")
    expected = _round(*eager_args)
    got = torch.compile(_round, fullgraph=True, backend="eager", dynamic=False)(*compiled_args)
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(eager_args[6], compiled_args[6]), "the cache was compacted the same way"


@pytest.mark.gpu
def test_a_whole_round_never_syncs_on_cuda() -> None:
    args = _inputs("cuda")
    _round(*args)  # warm-up: lazy CUDA initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _round(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


FORBIDDEN = re.compile(r"\.item\(|\.tolist\(|nonzero|\.cpu\(|\.numpy\(|\.synchronize\(|masked_select|\.unique\(")


@pytest.mark.parametrize("module", [tree, walk, sampling, compaction, attention], ids=lambda m: m.__name__)
def test_source_has_no_host_reads(module) -> None:
    source = inspect.getsource(module)
    assert not FORBIDDEN.findall(source)


def test_forbidden_pattern_catches_host_reads() -> None:
    assert FORBIDDEN.findall("x = scores.max().item()\ny = idx.tolist()\nz = torch.nonzero(m)")  == [
        ".item(", ".tolist(", "nonzero",
    ]
