"""CUDA graphs for speculative rounds: per shape bucket, the stages of a round as graphs, shared where they can be.

Why: a Qwen3-8B-shaped forward issues about a thousand kernels; launched one by one from Python that costs more than
the ~5 ms the GPU needs (``../shared/docs/gpu-facts.md``). A captured graph replays them with one launch.

A graph's key is the round's :class:`~ddtree.engine.round.RoundShape` bucketed by :func:`graph_key`: rows (batch
bucket), tree nodes (budget bucket), block size, and the cache lengths the attentions read (context bucket). The
stages of :class:`~ddtree.engine.runner.ModelRunner` (draft, tree, verify as the layers then the head and choice,
commit) are captured as five graphs sharing one memory pool, so the engine can record CUDA events between replays
and report the stage split of graphed rounds; keys that agree on what a stage reads share its graph
(:class:`RoundGraphs`).

Inputs: the per-row fields of a capture's static :class:`~ddtree.engine.round.RoundInputs` are views of one device
tensor per dtype (:class:`~ddtree.engine.round.PackedRows`), refreshed from a pinned host copy by one asynchronous
copy each per round (instead of a copy and a fill per field). The engine reads every round's result (a host sync)
before it builds the next round's inputs, so a pinned buffer is never rewritten while its previous copy is still
queued.

Padding rows (a bucket larger than the batch) point at the KV caches' scratch slot with budget 0, so their writes
never touch a live request. Capture happens lazily the first time a key is seen (an eager pass runs first on the
capture stream, as PyTorch requires: :class:`~ddtree.engine.graph_capture.Recorder`) and is bounded by
``max_graphs`` (least recently used keys are dropped). The engine's start-up warm-up (:mod:`ddtree.engine.warmup`)
captures a planned set through :meth:`RoundGraphs.capture` and :meth:`PrefillGraphs.capture` before it reports
ready; ``max_graphs`` is then sized to hold the plan.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from torch import Tensor

from ddtree.engine.graph_capture import Recorder
from ddtree.engine.round import (
    ChunkRows,
    PackedRows,
    PrefillInputs,
    RoundInputs,
    RoundShape,
    RoundWork,
    RowInputs,
    TreeStage,
    VerifyStage,
)
from ddtree.engine.runner import STAGE_SHAPE_FIELDS, ModelRunner, StageTimer


def bucket_rows(rows: int, max_rows: int) -> int:
    """Next power of two (1, 2, 4, ...), capped at the engine's batch size."""
    return min(1 << (rows - 1).bit_length(), max_rows)


def bucket_nodes(budget: int) -> int:
    """Tree budget bucket: 0 (AR), then 2^k - 1 and 2^k (1, 2, 3, 4, 7, 8, 15, 16, ...).

    Why both: a verify carries the budget's nodes plus the root, so budget 2^k - 1 fills exactly 2^k rows, a GEMM
    tile boundary, while budget 2^k spills one row past it. Rounding 63 up to 64 would make it pay for 65 rows."""
    if budget == 0:
        return 0
    power = 1 << (budget - 1).bit_length()
    return power if budget == power else power - 1


def bucket_length(length: int, cap: int) -> int:
    """Cache length read by attention: powers of two up to 1024, then multiples of 1024; capped at the cache."""
    length = max(length, 1)
    bucket = 1 << (length - 1).bit_length() if length <= 1024 else -(-length // 1024) * 1024
    return min(max(bucket, 64), cap)


def graph_key(shape: RoundShape, *, max_rows: int, cache_len: int) -> RoundShape:
    """The bucket a round falls in, as a shape of its own (every size rounded up, never down): the graph key.

    The drafter's length is the verify's bucket too (``draft_kv_len`` is a static bound on every row's start, so a
    larger one is exact): one length dimension instead of two, which halves the keys a warm-up must capture
    (``ddtree.engine.warmup``); the drafter reads past its own bucket only for roots within a tree's nodes of a
    bucket boundary."""
    nodes = bucket_nodes(shape.max_budget)
    length = bucket_length(max(shape.kv_len - shape.max_budget + nodes, shape.draft_kv_len), cache_len)
    return RoundShape(
        rows=bucket_rows(shape.rows, max_rows),
        max_budget=nodes,
        block_size=shape.block_size,
        kv_len=length,
        draft_kv_len=length,
        greedy=shape.greedy,
        filtered=shape.filtered,
        contiguous=shape.contiguous,
        logprobs=shape.logprobs,  # a log-prob round has its own graphs (a wider result: log-probs are captured)
        min_tokens=shape.min_tokens,  # so has a min_tokens round (the masking is captured)
        auto_width=shape.auto_width,  # and an auto round (wider tree selection, expected lengths in the result)
    )


def length_buckets_of(cache_len: int) -> list[int]:
    """Every value :func:`bucket_length` takes for a cache of ``cache_len`` positions, ascending."""
    out = {min(64 << i, cache_len) for i in range(5)}  # 64 .. 1024
    out.update(min(1024 * k, cache_len) for k in range(2, -(-cache_len // 1024) + 1))
    return sorted(b for b in out if b >= min(64, cache_len))


@dataclass(frozen=True)
class AttentionDims:
    """What the tree-attention launches of a round follow besides its shape (:func:`round_launches`): the target's
    and the drafter's head counts and head dim, the element size, the device's SM count.

    Why: with the tree-attention kernel the key length reaches a round's kernels only through the launch it picks
    (tiles, splits; the kernel reads each row's start on the device), so two length buckets that launch alike
    capture identical graphs and can share one (:func:`shared_key`). Only built where that holds: the verify
    through the kernel and not in exact mode (its kernels read the length); ``draft`` is None where the drafter
    attends through a dense mask (then a drafting key keeps its length)."""

    target: tuple[int, int, int]  # (heads, kv heads, head dim)
    draft: tuple[int, int, int] | None
    elem: int
    sms: int

    @classmethod
    def of(cls, target, drafter, kernels) -> AttentionDims | None:
        """Of a built engine's models (on their device) and :class:`~ddtree.engine.kernels.KernelSet`."""
        from ddtree.tuning import sm_count

        if not kernels.tree_attention or getattr(kernels, "exact", False):
            return None
        param = next(target.parameters())
        t = target.config
        draft = None
        if drafter is not None and kernels.draft_attention:
            d = drafter.config
            draft = (int(d.num_heads), int(d.num_kv_heads), int(d.head_dim))
        return cls((int(t.num_heads), int(t.num_kv_heads), int(t.head_dim)), draft, param.element_size(),
                   sm_count(param.device))


def round_launches(key: RoundShape, dims: AttentionDims, cache_len: int) -> tuple:
    """The tree-attention launches of a round of graph key ``key``: the verify's (rows x nodes + 1 tokens over
    ``kv_len``) and, for a drafting key, the drafter block's (rows x block_size over ``draft_kv_len`` + the block,
    as :meth:`~ddtree.models.drafter.DFlashDrafter.draft_hidden` launches it; its length itself where the drafter
    attends densely)."""
    from ddtree.models.tree_attention import plan_launch

    heads, kv, d = dims.target
    verify = plan_launch(key.rows, heads, kv, key.max_budget + 1, d, key.kv_len, dims.elem, dims.sms)
    if not key.drafts:
        return (verify,)
    if dims.draft is None:
        return verify, ("dense draft", key.draft_kv_len)
    heads, kv, d = dims.draft
    return verify, plan_launch(key.rows, heads, kv, key.block_size, d, min(key.draft_kv_len + key.block_size,
                                                                           cache_len), dims.elem, dims.sms)


def shared_key(key: RoundShape, dims: AttentionDims | None, cache_len: int) -> RoundShape:
    """The graph key whose graphs serve ``key``: the longest length bucket that launches every tree attention of
    the round exactly as ``key``'s does (``key`` itself without ``dims``). Pure; a larger length is exact (a bound
    on every row's start)."""
    if dims is None:
        return key
    return _shared_key(key, dims, cache_len)


@lru_cache(maxsize=4096)
def _shared_key(key: RoundShape, dims: AttentionDims, cache_len: int) -> RoundShape:
    mine = round_launches(key, dims, cache_len)
    best = key
    for length in length_buckets_of(cache_len):
        other = replace(key, kv_len=length, draft_kv_len=length)
        if length > best.kv_len and round_launches(other, dims, cache_len) == mine:
            best = other
    return best


def eager_chunk_dims(width: int, starts: list[int], cache_len: int) -> tuple[int, int]:
    """(padded width, kv_len) of an eager prefill chunk whose widest row takes ``width`` tokens: the width
    rounded up to a multiple of 16 and the key length bucketed like a round's, so that every eager chunk's kernel
    variants lie in a finite set the warm-up plans (``ddtree.engine.warmup.eager_chunks``). Padding columns are
    invisible (past each row's valid length), as the scheduler's padding to the widest row already is; the build's
    headroom keeps ``start + padded width`` inside the cache."""
    padded = -(-width // 16) * 16
    return padded, bucket_length(max(s + padded for s in starts), cache_len)


@dataclass
class _Front:
    """What keys with the same draft key share (:data:`~ddtree.engine.runner.STAGE_SHAPE_FIELDS`): the static
    inputs, their staging copies, and the draft stage's graph and output."""

    packed: PackedRows  # [F, rows] device buffers every sharing key's static inputs are views of
    host: PackedRows  # pinned staging copies of the two
    pad: PackedRows  # device copies of the padding rows, for rounds whose inputs are already on the device
    draft: torch.cuda.CUDAGraph | None  # None: the stage does nothing (no row drafts)
    draft_hidden: Tensor | None  # [R, L, H]
    users: int = 0  # captured keys that replay it
    valid_at: int = 0  # RoundGraphs.generation when its inputs were padding and its output last written


@dataclass
class _Tree:
    """The tree stage's and the verify's layers' graphs and outputs, shared by keys with the same tree key (every
    sampling, log-prob and min_tokens variant: those reach only the verify's head and choice)."""

    graph: torch.cuda.CUDAGraph
    forward: torch.cuda.CUDAGraph
    tree: TreeStage
    verify: VerifyStage  # the layers' outputs (hidden, normed); each key's choice graph fills a copy of its own
    front: _Front  # the draft stage whose inputs and output its graphs read
    users: int = 0
    valid_at: int = 0  # RoundGraphs.generation when its outputs were last written


@dataclass(frozen=True)
class ChunkKey:
    """The bucket of a mixed round's prompt chunk (:meth:`RoundGraphs.run_mixed`): rows, width, key length."""

    rows: int  # riders bucket (powers of two)
    width: int  # tokens per row: a power of two >= 16, at most min(mixed_chunk, prefill_chunk) rounded up to 16
    kv_len: int  # bucket_length of the furthest row's start + width


def chunk_key(chunk: ChunkRows, *, max_rows: int, max_width: int, cache_len: int) -> ChunkKey:
    """The key of ``chunk``; ``max_width``: the widest rider's row, min(mixed_chunk, prefill_chunk) rounded up to 16
    (inside the cache's headroom)."""
    take = chunk.ids.shape[1]
    width = min(max(16, 1 << (take - 1).bit_length()), max(max_width, -(-take // 16) * 16))
    return ChunkKey(rows=bucket_rows(len(chunk.slots), max_rows), width=width,
                    kv_len=bucket_length(max(chunk.start) + width, cache_len))


@dataclass
class _Mixed:
    """A round key's verify layers with a prompt chunk riding in them (one :class:`ChunkKey`): the graph, its static
    chunk buffer and its output."""

    packed: Tensor  # [rows * width + 3 * rows] long device: the ids row by row, then slots, starts, valid lengths
    graph: torch.cuda.CUDAGraph
    work: RoundWork  # its output: work.verify.prompt_normed [rows, 1, H], the states at each chunk row's last token


@dataclass
class _Captured:
    static: RoundInputs  # per-row fields are views of front.packed
    front: _Front
    tree: _Tree
    work: RoundWork
    # per timed stage (ModelRunner.STAGES): the graphs it replays in order (none: the stage does nothing); the
    # verify replays the shared layers' graph, then the key's own head-and-choice graph
    graphs: tuple[tuple[torch.cuda.CUDAGraph, ...], ...]
    mixed: dict[ChunkKey, _Mixed] = field(default_factory=dict)  # its mixed-round layers, by chunk key


def stage_key(shape: RoundShape, stage: str) -> tuple:
    """The part of a graph key that ``stage`` reads: keys equal on it share the stage's graph."""
    return tuple(getattr(shape, name) for name in STAGE_SHAPE_FIELDS[stage])


class RoundGraphs:
    """Captures and replays rounds; :meth:`run` is the graphed counterpart of :meth:`ModelRunner.round`.

    Stage sharing: a round key's draft graph (and its static inputs) is shared by every key with the same rows,
    block size and draft length; its tree graph and the verify's layers (the target without its head) by every key
    that also has the same node bucket, key length and auto width (:func:`stage_key`,
    :data:`~ddtree.engine.runner.STAGE_SHAPE_FIELDS`); only the verify's head and choice and the commit are
    captured per key. Why: ``full`` warm-up plans every node bucket and three sampling variants per length bucket,
    and the sampling flags reach only the head's choice, so the 36-layer forward was captured three times (the
    H200 stand-in: 972 keys, 297 tree keys, about 38 ms of recording a forward). Sharing is safe because a round
    replays its graphs back to back on one stream and reads a shared stage's output only within the round; it also
    keeps one copy of the drafter's states ``[R, L, H]`` per draft key (the head runs in the tree stage).
    """

    def __init__(self, runner: ModelRunner, *, max_rows: int, cache_len: int, max_graphs: int = 96,
                 attention: AttentionDims | None = None, recorder: Recorder | None = None,
                 max_chunk_width: int = 16) -> None:
        """attention: the launches' dimensions (:meth:`AttentionDims.of`): keys that launch alike share graphs.
        recorder: how captures run (:class:`~ddtree.engine.graph_capture.Recorder`: an eager pass per new signature).
        max_chunk_width: the widest chunk row of a mixed round (min(mixed_chunk, prefill_chunk) rounded up to 16:
        inside the cache's headroom)."""
        self.runner = runner
        self.attention = attention
        self.max_rows = max_rows
        self.cache_len = cache_len
        self.max_graphs = max_graphs
        self.recorder = recorder if recorder is not None else Recorder(runner.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[RoundShape, _Captured] = OrderedDict()
        self.fronts: dict[tuple, _Front] = {}
        self.trees: dict[tuple, _Tree] = {}
        self.scratch = runner.target_cache.scratch_slot
        self.captures = 0
        # Bumped by every replay that may write over a shared stage's inputs or outputs (a served round, a refresh
        # of an older shared stage): one marked valid at the current value needs no refresh before a capture (a
        # warm-up replays nothing but the graphs it just captured, which cannot overlap older live outputs).
        self.generation = 0
        self._pad = PackedRows.pack([RowInputs.padding(self.scratch)])  # [F, 1] host
        self.max_chunk_width = max_chunk_width
        self.max_mixed = 48  # mixed-round layer graphs held, least recently used dropped first
        self._mixed_order: OrderedDict[tuple[RoundShape, ChunkKey], None] = OrderedDict()
        self.mixed_captures = 0  # mixed-round layer graphs captured (lazily: a chunk's key is known only when it rides)
        self.mixed_capture_s = 0.0  # and the wall time they took

    def can_run(self, rows: int) -> bool:
        return self.runner.device.type == "cuda" and rows <= self.max_rows

    def key_for(self, shape: RoundShape) -> RoundShape:
        """The graph key of a round of ``shape`` (the shared one: :func:`shared_key`)."""
        return shared_key(graph_key(shape, max_rows=self.max_rows, cache_len=self.cache_len), self.attention,
                          self.cache_len)

    def stage_graphs(self) -> dict[str, int]:
        """Stage graphs held, by stage (shared ones once)."""
        return {"draft": sum(f.draft is not None for f in self.fronts.values()), "tree": len(self.trees),
                "forward": len(self.trees), "choose": len(self.graphs), "commit": len(self.graphs)}

    @torch.inference_mode()
    def run(self, rows_in: PackedRows, shape: RoundShape, timer: StageTimer,
            patch: Callable[[PackedRows], None] | None = None) -> tuple[Tensor, PackedRows]:
        """Replay the round of ``shape`` for ``rows_in``: host tensors (one pinned copy each) or device tensors
        (copied on the device, no host involvement); ``patch`` edits the real rows' device inputs after the copy
        (the scheduler's first tokens still on the device).

        Returns the device result ``[R, 2 + L]`` as :meth:`ModelRunner.round` does and the device inputs of the
        real rows, all views of the capture's buffers: the next replay of the same graph overwrites them, so
        anything that reads them must be queued before it."""
        key, cap, rows_in = self._captured(shape, rows_in)
        self._load(key, cap, rows_in, patch)
        for name, graphs in zip(ModelRunner.STAGES, cap.graphs, strict=True):
            with timer.stage(name):
                for graph in graphs:
                    graph.replay()
        rows = rows_in.rows
        return cap.work.result[:rows], PackedRows(cap.front.packed.longs[:, :rows], cap.front.packed.floats[:, :rows])

    @torch.inference_mode()
    def run_mixed(self, rows_in: PackedRows, shape: RoundShape, timer: StageTimer, chunk: ChunkRows,
                  patch: Callable[[PackedRows], None] | None = None) -> tuple[Tensor, PackedRows, Tensor]:
        """:meth:`run` for a mixed round: ``chunk``'s rows ride in the verify's layers (the key's layers graph
        swapped for one of the round key and the chunk's :class:`ChunkKey`, captured on first use). Returns also
        the final-normed states ``[P, 1, H]`` at each chunk row's last token (a copy: ``head_logits`` gives the
        first tokens' logits)."""
        key, cap, rows_in = self._captured(shape, rows_in)
        ckey = chunk_key(chunk, max_rows=self.max_rows, max_width=self.max_chunk_width, cache_len=self.cache_len)
        mixed = cap.mixed.get(ckey)
        if mixed is None:
            mixed = self._capture_mixed(key, cap, ckey)
        self._mixed_order.pop((key, ckey), None)
        self._mixed_order[(key, ckey)] = None
        p, w = chunk.ids.shape
        host = self._chunk_padding(ckey)
        ids, slots, start, valid = self._chunk_views(host, ckey)
        ids[:p, :w] = chunk.ids
        slots[:p] = torch.tensor(chunk.slots, dtype=torch.long)
        start[:p] = torch.tensor(chunk.start, dtype=torch.long)
        valid[:p] = torch.tensor(chunk.valid_len, dtype=torch.long)
        # a fresh pinned block per call, as a prefill replay's: a mixed round may be queued behind the round in
        # flight (a follow-up), whose own chunk copy from a buffer kept here might not have run yet
        mixed.packed.copy_(host.pin_memory() if mixed.packed.is_cuda else host, non_blocking=True)
        self._load(key, cap, rows_in, patch)
        prompt = None
        for name, graphs in zip(ModelRunner.STAGES, cap.graphs, strict=True):
            if name == "verify":  # the chunk's layers graph in place of the shared layers graph, then the choice
                graphs = (mixed.graph, *graphs[1:])
            with timer.stage(name):
                for graph in graphs:
                    graph.replay()
                    if graph is mixed.graph:  # copied out before the next graph, whose scratch may lie under it
                        prompt = mixed.work.verify.prompt_normed[:p].clone()
        rows = rows_in.rows
        return (cap.work.result[:rows], PackedRows(cap.front.packed.longs[:, :rows], cap.front.packed.floats[:, :rows]),
                prompt)

    def mixed_captured(self, shape: RoundShape, chunk: ChunkRows) -> bool:
        """Whether :meth:`run_mixed` of ``shape`` with ``chunk`` riding would replay a layers graph already
        captured (no capture on the way: the scheduler's capture budget, ``MIXED_CAPTURE_SHARE``)."""
        cap = self.graphs.get(self.key_for(shape))
        ckey = chunk_key(chunk, max_rows=self.max_rows, max_width=self.max_chunk_width, cache_len=self.cache_len)
        return cap is not None and ckey in cap.mixed

    def _captured(self, shape: RoundShape, rows_in: PackedRows) -> tuple[RoundShape, _Captured, PackedRows]:
        """The key of ``shape`` and its capture (made now if new); ``rows_in`` cloned when a capture would reset
        the buffers it is a view of."""
        self.generation += 1
        key = self.key_for(shape)
        cap = self.graphs.get(key)
        if cap is None:
            if rows_in.longs.is_cuda:  # views of a front's buffers, which the capture resets to padding
                rows_in = PackedRows(rows_in.longs.clone(), rows_in.floats.clone())
            cap = self._capture(key)
        else:
            self.graphs.move_to_end(key)
        return key, cap, rows_in

    def _load(self, key: RoundShape, cap: _Captured, rows_in: PackedRows,
              patch: Callable[[PackedRows], None] | None) -> None:
        """Copy ``rows_in`` and padding rows into the key's static inputs, then ``patch`` the real rows."""
        rows = rows_in.rows
        packed, host, pad = cap.front.packed, cap.front.host, cap.front.pad
        if rows_in.longs.is_cuda:  # inputs already on the device (a round advanced there from the previous one)
            packed.longs[:, :rows].copy_(rows_in.longs)
            packed.floats[:, :rows].copy_(rows_in.floats)
            if rows < key.rows:
                packed.longs[:, rows:].copy_(pad.longs[:, rows:])
                packed.floats[:, rows:].copy_(pad.floats[:, rows:])
        else:
            host.longs[:, :rows] = rows_in.longs
            host.longs[:, rows:] = self._pad.longs
            host.floats[:, :rows] = rows_in.floats
            host.floats[:, rows:] = self._pad.floats
            packed.longs.copy_(host.longs, non_blocking=True)
            packed.floats.copy_(host.floats, non_blocking=True)
        if patch is not None:
            patch(PackedRows(packed.longs[:, :rows], packed.floats[:, :rows]))

    @staticmethod
    def _chunk_views(packed: Tensor, key: ChunkKey) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """ids [rows, width], slots, starts, valid lengths [rows]: contiguous views of one flat buffer."""
        ids, slots, start, valid = _row_views(packed, key.rows, key.width, 3)
        return ids, slots, start, valid

    def _chunk_padding(self, key: ChunkKey) -> Tensor:
        """Host buffer of an all-padding chunk: token 0 at position 0 of the scratch slot, one valid token a row."""
        return _padding_rows(key.rows, key.width, 3, self.scratch)

    def _capture_mixed(self, key: RoundShape, cap: _Captured, ckey: ChunkKey) -> _Mixed:
        """Capture ``key``'s verify layers with a chunk of ``ckey`` riding in them. They read the key's tree stage
        outputs and write the shared layers' outputs (hidden, normed) that the key's choice graph reads. The eager
        passes and the recording run on padding rows (the front reset, its draft and tree stages replayed on them),
        as every capture does, so no live slot's cache is written."""
        runner = self.runner
        t0 = time.perf_counter()
        self.recorder.make_room()
        # padding rows in the front's inputs and valid outputs in its shared stages, refreshed as for any capture
        # that reuses them (the key's own: a live key's shared stages stay in the tables)
        front = self._front(key)
        tree = self._tree(key, cap.static, front)
        host = self._chunk_padding(ckey)
        packed = host.to(runner.device)
        ids, slots, start, valid = self._chunk_views(packed, ckey)
        work = RoundWork(draft_hidden=front.draft_hidden, tree=tree.tree)

        def layers() -> None:
            # Everything the graph reads is made inside it or held by the capture: last_index derived here sees a
            # replay's valid lengths, and a tensor made outside and held by nothing would be freed and its memory
            # reused while the graph still reads it (a device assert in the head's gather, H200).
            static = replace(cap.static, prefill=PrefillInputs(ids=ids, slots=slots, start=start, valid_len=valid,
                                                               last_index=valid - 1, kv_len=ckey.kv_len))
            runner.stage_forward(static, work)
            tree.verify.normed.copy_(work.verify.normed)
            if tree.verify.hidden is not None:
                tree.verify.hidden.copy_(work.verify.hidden)

        # eager passes for a new signature, and one retry after them for a first use it did not foresee (a key
        # length's attention variant), as the round keys' captures have
        sig = ("mixed", key.rows, key.block_size, key.max_budget, key.auto_width, ckey.rows, ckey.width)
        [(graph, _)] = self.recorder.record_stages(layers, [("mixed", layers)], self.pool, signature=sig)
        mixed = _Mixed(packed=packed, graph=graph, work=work)
        cap.mixed[ckey] = mixed
        self.mixed_captures += 1
        self.mixed_capture_s += time.perf_counter() - t0
        while len(self._mixed_order) >= self.max_mixed:  # the least recently used go first
            old_key, old_ckey = self._mixed_order.popitem(last=False)[0]
            old = self.graphs.get(old_key)
            if old is not None:
                old.mixed.pop(old_ckey, None)
        return mixed

    def capture(self, key: RoundShape) -> None:
        """Capture the graphs of ``key`` (a graph key) now unless they (or its shared key's) exist: the warm-up's
        entry point."""
        key = shared_key(key, self.attention, self.cache_len)
        if key not in self.graphs:
            with torch.inference_mode():
                self._capture(key)

    def _front(self, key: RoundShape) -> _Front:
        """The shared inputs and draft graph of ``key``'s draft key, captured on first use; either way its inputs
        hold padding rows and its draft output valid values when this returns (refreshed only if a replay since
        may have changed them: :attr:`generation`; see :meth:`_capture`)."""
        skey = stage_key(key, "draft")
        front = self.fronts.get(skey)
        if front is not None:
            if front.valid_at != self.generation:
                front.packed.longs.copy_(front.pad.longs)
                front.packed.floats.copy_(front.pad.floats)
                if front.draft is not None:
                    front.draft.replay()
                self.generation += 1
                front.valid_at = self.generation
            return front
        runner, rec = self.runner, self.recorder
        # repeat, not expand().contiguous(): for one row that returns the template itself, which a CPU run (no
        # pinned copy) would then load real rows into, making every later padding row a live request's
        host = PackedRows(self._pad.longs.repeat(1, key.rows).pin_memory(),
                          self._pad.floats.repeat(1, key.rows).pin_memory())
        packed = PackedRows(host.longs.to(runner.device), host.floats.to(runner.device))
        front = _Front(packed=packed, host=host, pad=PackedRows(packed.longs.clone(), packed.floats.clone()),
                       draft=None, draft_hidden=None, valid_at=self.generation)
        static = RoundInputs.from_packed(packed, key)
        if runner.drafts(static):
            work = RoundWork()
            # the drafter's kernels follow its rows and block; a new draft length may meet a first use (a retry)
            [(front.draft, _)] = rec.record_stages(
                lambda: runner.stage_draft(static, RoundWork()), [("draft", lambda: runner.stage_draft(static, work))],
                self.pool, signature=("draft", key.rows, key.block_size))
            front.draft.replay()
            front.draft_hidden = work.draft_hidden
        self.fronts[skey] = front
        return front

    def _tree(self, key: RoundShape, static: RoundInputs, front: _Front) -> _Tree:
        """The shared tree and layers graphs of ``key``'s tree key, captured on first use (and replayed then);
        a reused one is replayed on the front's padding rows when a replay since may have changed its outputs
        (:attr:`generation`), so that they hold valid values for later eager passes."""
        skey = stage_key(key, "tree")
        tree = self.trees.get(skey)
        if tree is not None and tree.front is front:
            if tree.valid_at != self.generation:
                tree.graph.replay()
                tree.forward.replay()
                self.generation += 1
                tree.valid_at = self.generation
            return tree
        runner, rec = self.runner, self.recorder

        def eager() -> None:
            scratch = RoundWork(draft_hidden=front.draft_hidden)
            runner.stage_tree(static, scratch)
            runner.stage_forward(static, scratch)

        # the matmuls and norms follow rows x nodes; the key length picks the attention's launch, whose variants
        # the warm-up has compiled (ddtree.engine.precompile) but this process may not have loaded yet: such a
        # first use fails the capture, which record_stages retries after eager passes
        sig = ("forward", key.rows, key.block_size, key.max_budget, key.auto_width)
        work = RoundWork(draft_hidden=front.draft_hidden)
        (graph, _), (forward, _) = rec.record_stages(
            eager, [("tree", lambda: runner.stage_tree(static, work)),
                    ("forward", lambda: runner.stage_forward(static, work))], self.pool, signature=sig)
        graph.replay()
        forward.replay()
        tree = self.trees[skey] = _Tree(graph=graph, forward=forward, tree=work.tree, verify=work.verify, front=front,
                                        valid_at=self.generation)
        return tree

    def _capture(self, key: RoundShape) -> _Captured:
        """Capture ``key``'s own graphs over its shared stages (made or reused).

        Why the reset and the replays of reused stages (in :meth:`_front`, :meth:`_tree`) before anything runs: a
        reused front's inputs hold the last round's real rows, which an eager pass or a replay would write into
        (live slots' caches), and a shared stage's outputs can hold another key's scratch (all keys share one
        pool, and an older graph's scratch may lie under a newer capture's outputs: safe within a round, not
        across them). A capture that fails leaves no shared stage that no captured key uses."""
        self.recorder.make_room()
        had = (set(self.fronts), set(self.trees))
        try:
            cap = self._capture_stages(key)
        except BaseException:
            for table, before in ((self.trees, had[1]), (self.fronts, had[0])):
                for skey in [k for k, v in table.items() if k not in before and v.users == 0]:
                    del table[skey]
            raise
        self.graphs[key] = cap
        self.captures += 1
        while len(self.graphs) > self.max_graphs:  # each key keeps its stage outputs (choices, result) allocated
            self._drop(self.graphs.popitem(last=False)[0])
        return cap

    def _capture_stages(self, key: RoundShape) -> _Captured:
        runner, rec = self.runner, self.recorder
        front = self._front(key)
        static = RoundInputs.from_packed(front.packed, key)
        tree = self._tree(key, static, front)

        def fresh() -> RoundWork:  # this key's view of the shared outputs; its own stages fill the rest
            layers = VerifyStage(hidden=tree.verify.hidden, normed=tree.verify.normed)
            return RoundWork(draft_hidden=front.draft_hidden, tree=tree.tree, verify=layers)

        def choose_commit() -> None:
            scratch = fresh()
            runner.stage_choose(static, scratch)
            runner.stage_commit(static, scratch)

        # the head, the choice and the commit read no cache length: keys that differ only there run the same kernels
        sig = ("choose", replace(key, kv_len=0, draft_kv_len=0))
        work = fresh()
        (choose, _), (commit, _) = rec.record_stages(
            choose_commit, [("choose", lambda: runner.stage_choose(static, work)),
                            ("commit", lambda: runner.stage_commit(static, work))], self.pool, signature=sig)
        graphs = {"draft": () if front.draft is None else (front.draft,), "tree": (tree.graph,),
                  "verify": (tree.forward, choose), "commit": (commit,)}
        front.users += 1
        tree.users += 1
        return _Captured(static=static, front=front, tree=tree, work=work,
                         graphs=tuple(graphs[name] for name in ModelRunner.STAGES))

    def _drop(self, key: RoundShape) -> None:
        """Forget the shared stages an evicted key was the last to use (its own graphs went with it)."""
        for table, stage in ((self.fronts, "draft"), (self.trees, "tree")):
            skey = stage_key(key, stage)
            shared = table[skey]
            shared.users -= 1
            if shared.users == 0:
                del table[skey]


@dataclass(frozen=True)
class PrefillKey:
    rows: int  # batch bucket
    width: int  # chunk width bucket (power of two >= 16)


def prefill_key(rows: int, width: int, max_rows: int) -> PrefillKey:
    """The key of a prefill chunk of ``rows`` rows, the widest ``width`` tokens."""
    return PrefillKey(rows=bucket_rows(rows, max_rows), width=max(16, 1 << (width - 1).bit_length()))


@dataclass
class _CapturedPrefill:
    packed: Tensor  # [rows * width + 2 * rows] long device: the ids row by row, then the slots, then valid lengths
    logits: Tensor  # [rows, V] the graph's output
    replay: Callable[[], None]  # torch.cuda.CUDAGraph.replay


class PrefillGraphs:
    """CUDA graphs of prefill chunks that start at position 0 (a whole short prompt, or a long one's first chunk).

    Why: an eager prefill of a short prompt is mostly Python launches on the Qwen3-8B stand-in (a 60-token prompt
    waited 25-50 ms for its first token, ~5 ms of it on the device), and each request joining a running batch
    stalled everyone's decoding that long (runs 12-13's closed-loop cells at concurrency 64: DDTree b4's round was
    17-23 ms of wall time for 12 ms of device stages). Prompts longer than ``max_width`` or continuing a chunked
    prompt stay eager: their device time dwarfs the launches.

    Key: (rows bucket, width bucket); padding rows prefill one token into the scratch slot, padding columns sit
    past each row's valid length (invisible, as in the eager path). Inputs are one pinned long tensor copied with one
    asynchronous copy; the engine reads the logits (a host sync) before it replays any prefill graph again."""

    def __init__(self, runner: ModelRunner, *, max_rows: int, max_width: int, max_tokens: int = 8192,
                 max_graphs: int = 32, recorder: Recorder | None = None) -> None:
        self.runner = runner
        self.recorder = recorder if recorder is not None else Recorder(runner.device)
        self.max_rows = max_rows
        self.max_width = max_width
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.pool = None  # its own graph memory pool (made at the first capture)
        self.graphs: dict[PrefillKey, _CapturedPrefill] = {}
        self.captures = 0

    def key_for(self, rows: int, width: int) -> PrefillKey:
        return prefill_key(rows, width, self.max_rows)

    def capture(self, key: PrefillKey) -> None:
        """Capture ``key`` now unless it exists (the warm-up's entry point; counts against ``max_graphs``)."""
        if key not in self.graphs:
            with torch.inference_mode():
                self._capture(key)

    def can_run(self, rows: int, width: int, starts: list[int]) -> bool:
        return self.runner.device.type == "cuda" and self.fits(rows, width, starts)

    def fits(self, rows: int, width: int, starts: list[int]) -> bool:
        """A chunk this class graphs: every row from position 0, within the row, width and token limits, and its
        graph captured already or room for one more.

        Why no eviction (the round graphs drop their least recently used): a capture costs about three eager
        prefills (two warm-up runs and the recording), more than a graph saves on one prompt, so a server whose
        prompts cycle through more shapes than ``max_graphs`` would pay it on every arrival. Past the cap, new
        shapes prefill eagerly."""
        if rows > self.max_rows or any(starts):
            return False
        key = self.key_for(rows, width)
        if key.width > self.max_width or key.rows * key.width > self.max_tokens:
            return False
        return key in self.graphs or len(self.graphs) < self.max_graphs

    @torch.inference_mode()
    def run(self, ids: Tensor, slots: list[int], valid_len: list[int]) -> Tensor:
        """Prefill ``ids [R, W]`` (host, padded) into ``slots`` with ``valid_len`` real tokens per row, every row
        from position 0; returns the device logits ``[R, V]`` at each row's last real token (a view of the graph's
        output buffer, valid until the next prefill replay)."""
        rows, width = ids.shape
        key = self.key_for(rows, width)
        cap = self.graphs.get(key)
        if cap is None:
            cap = self._capture(key)
        host = self._padding(key)
        ids_part, slots_part, valid_part = self._views(host, key)
        ids_part[:rows, :width] = ids
        slots_part[:rows] = torch.tensor(slots, dtype=torch.long)
        valid_part[:rows] = torch.tensor(valid_len, dtype=torch.long)
        cap.packed.copy_(host.pin_memory() if cap.packed.is_cuda else host, non_blocking=True)
        cap.replay()
        return cap.logits[:rows]

    @staticmethod
    def _views(packed: Tensor, key: PrefillKey) -> tuple[Tensor, Tensor, Tensor]:
        """ids [rows, width], slots [rows], valid lengths [rows]: contiguous views of one flat buffer (one copy
        moves them all; every consumer may assume unit strides)."""
        ids, slots, valid = _row_views(packed, key.rows, key.width, 2)
        return ids, slots, valid

    def _padding(self, key: PrefillKey) -> Tensor:
        """Host inputs of an all-padding chunk: token 0, the scratch slot, one valid token."""
        return _padding_rows(key.rows, key.width, 2, self.runner.target_cache.scratch_slot)


    def _capture(self, key: PrefillKey) -> _CapturedPrefill:
        runner = self.runner
        packed = self._padding(key).to(runner.device)

        def prefill() -> Tensor:
            # Inputs are views of `packed` and last_index is derived inside, so a replay sees the new values.
            ids, slots, valid = self._views(packed, key)
            return runner.prefill(PrefillInputs(ids=ids, slots=slots, start=torch.zeros_like(valid), valid_len=valid,
                                                last_index=valid - 1, kv_len=key.width))

        logits, replay = self._record(prefill)
        cap = _CapturedPrefill(packed=packed, logits=logits, replay=replay)
        self.graphs[key] = cap
        self.captures += 1
        return cap

    def _record(self, fn: Callable[[], Tensor]) -> tuple[Tensor, Callable[[], None]]:
        """Capture ``fn`` (an eager pass on the capture stream first, as PyTorch requires): its output and the
        replay."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.recorder.make_room()
        self.recorder.warm_up(fn)  # every prefill key is new (its rows x width)
        graph, out = self.recorder.record(fn, self.pool, stage="prefill")
        return out, graph.replay


def warm_up(fn: Callable[[], object]) -> None:
    """Run ``fn`` twice on a side stream before capturing it, as PyTorch requires (lazy initialisation, cuBLAS
    workspaces, Triton autotuning must not happen inside a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def _row_views(packed: Tensor, rows: int, width: int, fields: int) -> tuple[Tensor, ...]:
    """The views of a chunk's flat long buffer ``[rows * width + fields * rows]``: ids ``[rows, width]``, then
    ``fields`` per-row fields ``[rows]`` (slots first, valid lengths last), all contiguous."""
    n = rows * width
    return (packed[:n].view(rows, width), *(packed[n + i * rows : n + (i + 1) * rows] for i in range(fields)))


def _padding_rows(rows: int, width: int, fields: int, scratch: int) -> Tensor:
    """A host chunk buffer (:func:`_row_views`) of padding rows: token 0 at position 0 of the scratch slot, one valid
    token a row (the other fields 0)."""
    host = torch.zeros(rows * width + fields * rows, dtype=torch.long)
    views = _row_views(host, rows, width, fields)
    views[1].fill_(scratch)
    views[-1].fill_(1)
    return host
