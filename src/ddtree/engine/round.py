"""The round contract: what one speculative round carries, in two frozen records.

Read this module to know what a round is made of:

- :class:`RoundShape`: every host-known size of a round (rows, tree nodes, block size, the cache lengths the
  attentions read, and the three batch-wide flags that pick code paths). Bucketed by
  :func:`ddtree.engine.cuda_graphs.graph_key`, the same type is the CUDA graph key: a graph is captured per shape.
- :class:`RowInputs`: one request's entries. Its fields, in order, *are* the packing order: integer fields go to
  one ``long`` tensor ``[len(LONG_FIELDS), R]`` and float fields to one ``float32`` tensor
  ``[len(FLOAT_FIELDS), R]`` (:class:`PackedRows`), so a round moves to the device (or into a graph's static
  inputs) with one copy per dtype, and nothing matches positions by a comment.
- :class:`RoundInputs`: what the runner's stages read: the shape plus one device tensor ``[R]`` per row field,
  views of the packed tensors, under the row field's own name.

The stages' outputs are typed too (:class:`TreeStage`, :class:`VerifyStage`, held by :class:`RoundWork`), so the
CUDA-graph runner can capture each stage on its own and the engine can time the split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree import speculative
from ddtree.engine.api import MAX_STOP_IDS
from ddtree.speculative.attention import TreeVisibility

NO_WINDOW = 1 << 30  # RowInputs.window of a row that sees its whole context


@dataclass(frozen=True)
class RoundShape:
    """The host-known sizes of one round; nothing inside a round reads a device value to learn them."""

    rows: int  # requests in the round (a graph key: the batch bucket, padding rows included)
    max_budget: int  # N - 1: tree nodes past the root (0 when no row drafts, or budget auto chose no tree)
    block_size: int  # batch max block size (L + 1); 1 when no row drafts
    kv_len: int  # target cache positions the verify reads: >= max(start) + N
    draft_kv_len: int  # drafter cache positions the draft reads: >= max(start)
    greedy: bool  # every row has temperature 0
    filtered: bool  # some row uses top-p < 1 or top-k > 0 (else sampling skips the vocabulary sort)
    contiguous: bool  # every row is AR or DFlash: accepted nodes are already contiguous (compaction skipped)
    # some row asked for log-probs: the verify keeps its logits and the result carries the accepted nodes'
    # log-probs (ddtree.engine.logprobs); every row of such a round pays for them, rounds without pay nothing
    logprobs: bool = False
    # some row has min_tokens > 0: the verify masks each row's banned ids (RowInputs.banned) at the nodes whose
    # output index is below its min_tokens; rounds without skip the masking
    min_tokens: bool = False
    # some row has budget "auto" (ddtree.engine.auto_budget): the tree stage selects this many nodes (>= max_budget),
    # verifies the first max_budget and appends each row's expected lengths E(1 .. auto_width) to the result; 0: none.
    # A round at budget 0 (drafts is False) keeps it (the curve width above 0) but drafts, selects and appends nothing
    auto_width: int = 0

    @property
    def keeps_context(self) -> bool:
        """Whether some row drafts in its lifetime (block size above 1): the verify returns the target's feature
        layers and the commit appends the accepted nodes' to the drafter's context."""
        return self.block_size > 1

    @property
    def drafts(self) -> bool:
        """Whether the drafter drafts this round: some row drafts and the round verifies nodes past the root. An
        auto round at budget 0 (``max_budget`` 0 with a block above 1: budget auto chose no tree) drafts nothing
        but keeps the drafter's context (:attr:`keeps_context`), so its rows can draft again in a later round."""
        return self.block_size > 1 and self.max_budget > 0

    @property
    def commit_width(self) -> int:
        """Positions per row the commit walks (the result's token columns): the block's ``L + 1`` when the round
        drafts, else 1 (the root's bonus token alone)."""
        return self.block_size if self.drafts else 1

    @property
    def draft_depths(self) -> int:
        """Depths of the block whose drafter logits the tree stage computes: a tree of B nodes past the root is at
        most B deep, so no tree of this round (``max(max_budget, auto_width)`` nodes) reaches past that depth;
        at most the block's ``block_size - 1``, 0 when the round drafts nothing."""
        return min(self.block_size - 1, max(self.max_budget, self.auto_width)) if self.drafts else 0


@dataclass(frozen=True)
class RowInputs:
    """One request's inputs to a round. Field order is the packing order (ints, then floats; see the module)."""

    slot: int  # KV cache slot
    root_token: int  # the last committed token, the tree's root
    start: int  # position of the root (= committed KV length)
    budget: int  # draft nodes to verify, 0 for AR
    topk: int  # most candidates per depth, 0 = no cap
    depth_limit: int  # block_size - 1 (0 for AR)
    window: int  # drafter context window (NO_WINDOW: all)
    top_k: int  # sampling top-k of the target's distribution, 0 = off
    seed: int  # the request's sampling seed
    step: int  # tokens generated so far (the sampling counter)
    min_tokens: int  # SamplingParams.min_tokens: banned ids are masked at output indices below it (0: never)
    temperature: float  # 0 = greedy
    top_p: float
    # 1: budget "auto" (the scheduler chose this round's budget; a follow-up round queued on the device may set
    # another, PackedRows.advanced), 0: the request's own budget
    auto: int = 0
    # the ids min_tokens masks (EOS ids unless ignore_eos, stop_token_ids): packed after the long fields as
    # MAX_STOP_IDS rows, padded with -1 (masks nothing)
    banned: tuple[int, ...] = ()

    @classmethod
    def padding(cls, scratch_slot: int) -> RowInputs:
        """A row that fills a graph's bucket: the KV caches' scratch slot, budget 0, greedy; it never touches a
        live request's cache."""
        return cls(slot=scratch_slot, root_token=0, start=0, budget=0, topk=0, depth_limit=0, window=NO_WINDOW,
                   top_k=0, seed=0, step=0, min_tokens=0, temperature=0.0, top_p=1.0)


LONG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RowInputs) if f.type in ("int", int))
FLOAT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RowInputs) if f.type in ("float", float))
assert len(LONG_FIELDS) + len(FLOAT_FIELDS) + 1 == len(dataclasses.fields(RowInputs)), "RowInputs: int or float fields"


@dataclass(frozen=True)
class PackedRows:
    """Rows packed by dtype: ``longs [len(LONG_FIELDS), R]``, ``floats [len(FLOAT_FIELDS), R]`` (host or device)."""

    longs: Tensor
    floats: Tensor

    @classmethod
    def pack(cls, rows: Sequence[RowInputs]) -> PackedRows:
        for r in rows:
            if len(r.banned) > MAX_STOP_IDS:
                raise ValueError(f"RowInputs.banned holds at most {MAX_STOP_IDS} ids, got {len(r.banned)}")
        longs = torch.tensor([[getattr(r, f) for f in LONG_FIELDS]
                              + list(r.banned) + [-1] * (MAX_STOP_IDS - len(r.banned)) for r in rows],
                             dtype=torch.long)
        floats = torch.tensor([[float(getattr(r, f)) for f in FLOAT_FIELDS] for r in rows], dtype=torch.float32)
        return cls(longs=longs.T.reshape(len(LONG_FIELDS) + MAX_STOP_IDS, len(rows)),
                   floats=floats.T.reshape(len(FLOAT_FIELDS), len(rows)))

    @property
    def rows(self) -> int:
        return self.longs.shape[1]

    def field(self, name: str) -> Tensor:
        """The ``[R]`` view of one row field."""
        if name in LONG_FIELDS:
            return self.longs[LONG_FIELDS.index(name)]
        return self.floats[FLOAT_FIELDS.index(name)]

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(self.longs.contiguous().to(device, non_blocking=True),
                          self.floats.contiguous().to(device, non_blocking=True))

    def advanced(self, result: Tensor, auto_budget: int | None = None) -> PackedRows:
        """The next round's rows from this round's device ``result`` (:meth:`ModelRunner.round`), on the device:
        each row's root is the last token it commits, its position and step move by the tokens it commits; with
        ``auto_budget``, the budget of every "auto" row becomes it (budget auto's next size, chosen on the host)."""
        n = result[:, 0]
        longs = self.longs.clone()
        longs[LONG_FIELDS.index("root_token")] = torch.gather(result, 1, n[:, None])[:, 0]  # result[:, 1 + n - 1]
        longs[LONG_FIELDS.index("start")] += n
        longs[LONG_FIELDS.index("step")] += n
        if auto_budget is not None:
            longs[LONG_FIELDS.index("budget")].masked_fill_(longs[LONG_FIELDS.index("auto")] == 1, auto_budget)
        return PackedRows(longs, self.floats)


@dataclass
class PrefillInputs:
    """A prompt chunk: a prefill step's whole input (:meth:`~ddtree.engine.runner.ModelRunner.prefill`), or the
    chunk a mixed round carries in its verify forward (:attr:`RoundInputs.prefill`)."""

    ids: Tensor  # [R, T] long, prompt chunk (padded)
    slots: Tensor  # [R] long
    start: Tensor  # [R] long, prompt tokens already in the cache
    valid_len: Tensor  # [R] long, real tokens in this chunk
    last_index: Tensor  # [R] long, valid_len - 1
    kv_len: int  # static bound >= max(start) + T: the cache positions the chunk's attention reads


@dataclass(frozen=True)
class ChunkRows:
    """A mixed round's prompt chunk on the host, before it becomes :class:`PrefillInputs` on the device (eagerly,
    or in a CUDA graph's static buffers: :meth:`ddtree.engine.cuda_graphs.RoundGraphs.run_mixed`)."""

    ids: Tensor  # [P, W] long host, each row's tokens then zeros
    slots: tuple[int, ...]  # [P]
    start: tuple[int, ...]  # [P] prompt tokens already in the cache
    valid_len: tuple[int, ...]  # [P] real tokens of each row


@dataclass(frozen=True)
class RoundInputs:
    """A round as the runner's stages read it: the shape and one ``[R]`` device tensor per :class:`RowInputs`
    field (same names), views of a :class:`PackedRows`."""

    shape: RoundShape
    slot: Tensor
    root_token: Tensor
    start: Tensor
    budget: Tensor
    topk: Tensor
    depth_limit: Tensor
    window: Tensor
    top_k: Tensor
    seed: Tensor
    step: Tensor
    min_tokens: Tensor
    temperature: Tensor
    top_p: Tensor
    auto: Tensor
    banned: Tensor  # [MAX_STOP_IDS, R] the ids min_tokens masks, -1 = none
    # a mixed round: prompt chunks of other requests (not rows of the round) that ride in its verify forward
    # (ModelRunner.stage_forward); rounds with one run eagerly, never from a CUDA graph
    prefill: PrefillInputs | None = None

    @classmethod
    def from_packed(cls, packed: PackedRows, shape: RoundShape) -> RoundInputs:
        """Views of ``packed`` (a graph's static inputs stay views of its buffers, refreshed by one copy each)."""
        n = len(LONG_FIELDS)
        fields = dict(zip(LONG_FIELDS, packed.longs[:n].unbind(0), strict=True))
        fields.update(zip(FLOAT_FIELDS, packed.floats.unbind(0), strict=True))
        return cls(shape=shape, banned=packed.longs[n:], **fields)


@dataclass
class TreeStage:
    """The tree stage's output: the trees and where their nodes sit."""

    trees: speculative.Trees
    positions: Tensor  # [R, N] RoPE positions (start + depth)
    write_pos: Tensor  # [R, N] cache indices the verify writes (start + i)
    # prefix + ancestors, in the form that picks the verify's attention path (KernelSet.tree_attention): the
    # TreeVisibility the tree-attention kernel reads, or the dense [R, N, kv_len] mask (built only then)
    visibility: TreeVisibility | Tensor
    expected: Tensor | None = None  # [R, auto_width] float32 E(1 .. W) of rounds with RoundShape.auto_width


@dataclass
class VerifyStage:
    """The verify stage's output, in its two parts: the target's layers over the tree (:meth:`ModelRunner.
    stage_forward`: ``hidden``, ``normed``), then its head and choice at each node (:meth:`ModelRunner.stage_choose`:
    ``choices``, ``logits``). Why two: the layers read no sampling flag, so the CUDA-graph runner captures them once
    for every sampling variant of a tree key and only the small head-and-choice graph per key."""

    hidden: Tensor | None  # [R, N, F] target features for the drafter (None when no row drafts)
    normed: Tensor  # [R, N, H] the final-normed states the head reads
    choices: Tensor | None = None  # [R, N] the target's token at each node (argmax or sampled)
    logits: Tensor | None = None  # [R, N, V] the verify's logits, kept only when RoundShape.logprobs
    prompt_normed: Tensor | None = None  # [P, 1, H] a mixed round's final-normed states at each chunk's last token


@dataclass
class RoundWork:
    """The stages' outputs of one round; each stage fills its own field. A captured graph's outputs live here."""

    # [R, L, H] the drafter's final-normed states at depths 1 .. L (its head runs in the tree stage, over the
    # RoundShape.draft_depths a tree can reach), None when no row drafts
    draft_hidden: Tensor | None = None
    tree: TreeStage | None = None
    verify: VerifyStage | None = None
    # [R, 1 + (L + 1)]: tokens committed (bonus included), then the tokens; with RoundShape.logprobs followed by
    # the log-prob columns of ddtree.engine.logprobs.pack_round_logprobs ((L + 1) * (1 + 2 * MAX_LOGPROBS)); with
    # RoundShape.auto_width the accepted path's node indices (L + 1 columns, walk_trees' path), then the last
    # auto_width columns TreeStage.expected (logprobs.float_bits)
    result: Tensor | None = None
    first_logits: Tensor | None = None  # [P, V] a mixed round's logits at each chunk's last token (RoundInputs.prefill)
