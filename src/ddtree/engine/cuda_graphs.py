"""CUDA graphs for speculative rounds: one set of four captured stages per shape bucket.

Why: a Qwen3-8B-shaped forward issues about a thousand kernels; launched one by one from Python that costs more than
the ~5 ms the GPU needs (``../shared/docs/gpu-facts.md``). A captured graph replays them with one launch.

Each :class:`GraphKey` fixes every shape of a round: rows (batch bucket), tree nodes (budget bucket), block size,
and the cache lengths the attentions read (context bucket). The four stages of
:class:`~ddtree.engine.runner.ModelRunner` (draft, tree, verify, commit) are captured as four graphs sharing one
memory pool, so the engine can record CUDA events between replays and report the stage split of graphed rounds.

Padding rows (a bucket larger than the batch) point at the KV caches' scratch slot with budget 0, so their writes
never touch a live request. Capture happens lazily the first time a key is seen (warm-up runs on a side stream
first, as PyTorch requires) and is bounded by ``max_graphs`` (least recently used graphs are dropped).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.engine.runner import ModelRunner, RoundInputs, StageTimer

_TENSOR_FIELDS = tuple(
    f.name for f in dataclasses.fields(RoundInputs) if f.type in ("Tensor", Tensor)
)


def bucket_rows(rows: int, max_rows: int) -> int:
    """Next power of two (1, 2, 4, ...), capped at the engine's batch size."""
    return min(1 << (rows - 1).bit_length(), max_rows)


def bucket_nodes(budget: int) -> int:
    """Tree budget bucket: 0 (AR), then powers of two."""
    return 0 if budget == 0 else 1 << (budget - 1).bit_length()


def bucket_length(length: int, cap: int) -> int:
    """Cache length read by attention: powers of two up to 1024, then multiples of 1024; capped at the cache."""
    length = max(length, 1)
    bucket = 1 << (length - 1).bit_length() if length <= 1024 else -(-length // 1024) * 1024
    return min(max(bucket, 64), cap)


@dataclass(frozen=True)
class GraphKey:
    rows: int
    max_budget: int
    block_size: int
    kv_len: int
    draft_kv_len: int
    greedy: bool
    filtered: bool
    contiguous: bool


@dataclass
class _Captured:
    static: RoundInputs
    work: dict
    graphs: list  # [torch.cuda.CUDAGraph] * 4, in ModelRunner.STAGES order


class RoundGraphs:
    """Captures and replays rounds; :meth:`run` is a drop-in for :meth:`ModelRunner.round`."""

    def __init__(self, runner: ModelRunner, *, max_rows: int, cache_len: int, max_graphs: int = 96) -> None:
        self.runner = runner
        self.max_rows = max_rows
        self.cache_len = cache_len
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[GraphKey, _Captured] = OrderedDict()
        self.scratch = runner.target_cache.scratch_slot
        self.captures = 0

    def can_run(self, inp: RoundInputs) -> bool:
        return self.runner.device.type == "cuda" and inp.slots.shape[0] <= self.max_rows

    def key_for(self, inp: RoundInputs) -> GraphKey:
        """The bucket a round falls in (every size rounded up, never down)."""
        nodes = bucket_nodes(inp.max_budget)
        return GraphKey(
            rows=bucket_rows(inp.slots.shape[0], self.max_rows),
            max_budget=nodes,
            block_size=inp.block_size,
            kv_len=bucket_length(inp.kv_len - inp.max_budget + nodes, self.cache_len),
            draft_kv_len=bucket_length(inp.draft_kv_len, self.cache_len),
            greedy=inp.greedy,
            filtered=inp.filtered,
            contiguous=inp.contiguous,
        )

    @torch.inference_mode()
    def run(self, inp: RoundInputs, timer: StageTimer) -> tuple[Tensor, Tensor]:
        key = self.key_for(inp)
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(key)
        else:
            self.graphs.move_to_end(key)
        rows = inp.slots.shape[0]
        self._load(cap.static, inp, rows)
        for name, graph in zip(ModelRunner.STAGES, cap.graphs, strict=False):
            with timer.stage(name):
                graph.replay()
        return cap.work["new_tokens"][:rows], cap.work["num_accepted"][:rows]

    # ---- internals ---------------------------------------------------------------------------------------------
    def _padding(self, key: GraphKey) -> RoundInputs:
        dev = self.runner.device
        rows = key.rows

        def longs(value: int) -> Tensor:
            return torch.full((rows,), value, dtype=torch.long, device=dev)

        def floats(value: float) -> Tensor:
            return torch.full((rows,), value, dtype=torch.float32, device=dev)

        return RoundInputs(
            slots=longs(self.scratch), root_tokens=longs(0), start=longs(0), budget=longs(0), topk=longs(0),
            depth_limit=longs(0), window=longs(1 << 30), temperature=floats(0.0), top_p=floats(1.0),
            top_k=longs(0), seed=longs(0), step=longs(0), max_budget=key.max_budget, block_size=key.block_size,
            kv_len=key.kv_len, draft_kv_len=key.draft_kv_len, greedy=key.greedy, filtered=key.filtered,
            contiguous=key.contiguous,
        )

    def _load(self, static: RoundInputs, inp: RoundInputs, rows: int) -> None:
        """Copy a batch into the static inputs; reset the padding rows (a previous batch may have used them)."""
        pad = self._pad_values
        for name in _TENSOR_FIELDS:
            dst = getattr(static, name)
            dst[:rows].copy_(getattr(inp, name), non_blocking=True)
            if rows < dst.shape[0]:
                dst[rows:].fill_(pad[name])

    @property
    def _pad_values(self) -> dict:
        return {"slots": self.scratch, "root_tokens": 0, "start": 0, "budget": 0, "topk": 0, "depth_limit": 0,
                "window": 1 << 30, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "step": 0}

    def _capture(self, key: GraphKey) -> _Captured:
        runner = self.runner
        static = self._padding(key)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation, cuBLAS workspaces, autotuning
                work: dict = {}
                for name in ModelRunner.STAGES:
                    getattr(runner, f"stage_{name}")(static, work)
        torch.cuda.current_stream().wait_stream(side)
        work = {}
        graphs = []
        for name in ModelRunner.STAGES:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                getattr(runner, f"stage_{name}")(static, work)
            graphs.append(graph)
        cap = _Captured(static=static, work=work, graphs=graphs)
        self.graphs[key] = cap
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return cap
