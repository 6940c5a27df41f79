"""The device side of the engine: a prefill chunk and one speculative round, as fixed sequences of tensor ops.

One round for R requests (rows) that may each use a different method, budget, top-k, block size and window::

    draft   drafter.draft_hidden         [R] roots            -> [R, L, H]   (L = batch max block size - 1)
    tree    drafter.head at depths 1 .. D    [R, D, H]            -> [R, D, V]   (D = RoundShape.draft_depths)
            speculative.build_trees             [R, D, V]            -> Trees, N = batch max budget + 1 nodes
            speculative.tree_positions / build_attention_mask        -> positions [R, N], TreeVisibility or
                                                                        mask [R, N, kv_len]
    verify  target.forward, no head (tree tokens, ancestor visibility) -> normed [R, N, H], features [R, N, F]
            target.head_logits, then argmax or speculative.sample_choices    -> logits [R, N, V], choices [R, N]
    commit  speculative.walk_trees                                   -> path [R, L + 1], num_accepted [R]
            speculative.compact_cache (target K and V)                  accepted nodes -> start .. start + n - 1
            drafter.append_context (features of accepted nodes)  drafter context grows by n
    host    to_host(result)                                   [R, 2 + L]: the one place results cross to the host

AR rows have budget 0 (a tree of the root alone); so do the rows of an auto round at budget 0, whose round drafts
nothing but whose verify still returns the features the commit appends (``RoundShape.drafts`` against
``keeps_context``: the drafter's context stays whole for the rounds that draft again); DFlash rows have top-k 1 and budget = depth, which makes
``build_trees`` return exactly the drafter's top-1 chain. Nothing inside a round reads a device value on the host:
every size (N, L, kv_len) is known on the host from the requests' settings and committed lengths.

Kernels: the runner holds the engine's :class:`~ddtree.engine.kernels.KernelSet` and passes it to every call it
governs: the whole set to the model calls (``kernels=``), one bool each to the core's functions, and the verify's
and prefill's attention path as the type of the visibility it hands the target (a ``TreeVisibility`` for the
tree-attention kernel, else the dense mask).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ddtree import speculative
from ddtree.engine.kernels import KernelSet
from ddtree.engine.logprobs import float_bits, pack_round_logprobs
from ddtree.engine.min_tokens import mask_min_tokens
from ddtree.engine.round import PrefillInputs, RoundInputs, RoundWork, TreeStage, VerifyStage
from ddtree.models import DFlashDrafter, KVCache, TargetModel
from ddtree.models.target import Segment
from ddtree.speculative import tree_select
from ddtree.speculative.attention import TreeVisibility

__all__ = ["STAGE_SHAPE_FIELDS", "HostCopy", "ModelRunner", "PrefillInputs", "RoundInputs", "StageTimer",
           "root_only_trees", "to_host"]

# The RoundShape fields each of the first stages reads (its inputs' sizes included: ``rows``). Rounds equal on
# them run the same draft (or tree) stage, so the CUDA-graph runner shares that stage's graph among their keys
# (ddtree.engine.cuda_graphs.stage_key); tests/engine/test_round_contract.py checks the stages read no other field.
# The verify's head and choice (stage_choose) and the commit read the rest (sampling flags, log-probs, min_tokens,
# contiguous) and are captured per key.
STAGE_SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    # drafts: a derived value (RoundShape.drafts), in the key as such: the draft graphs of every node bucket above 0
    # stay one, and an auto round at budget 0 (no draft) gets a front of its own
    "draft": ("rows", "block_size", "draft_kv_len", "drafts"),
    "tree": ("rows", "block_size", "draft_kv_len", "max_budget", "kv_len", "auto_width", "drafts"),
    # the verify's layers (stage_forward): the tree's fields (it reads the tree stage's outputs) and nothing more
    "forward": ("rows", "block_size", "draft_kv_len", "max_budget", "kv_len", "auto_width", "drafts"),
}


class StageTimer:
    """Wall time per stage. On CUDA it records events and reads them only after the round's one host sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
        else:
            begin = time.perf_counter()
            yield
            end = time.perf_counter()
        self._marks.append((name, begin, end))

    def collect(self) -> dict[str, float]:
        """Seconds per stage; call after the host sync (events are complete by then)."""
        out: dict[str, float] = {}
        for name, begin, end in self._marks:
            secs = begin.elapsed_time(end) / 1e3 if self.cuda else end - begin  # type: ignore[union-attr,operator]
            out[name] = out.get(name, 0.0) + secs
        self._marks.clear()
        return out


def root_only_trees(root_tokens: Tensor) -> speculative.Trees:
    """The tree of an AR round: the root alone (N = 1)."""
    r = root_tokens.shape[0]
    dev = root_tokens.device
    return speculative.Trees(
        tokens=root_tokens.view(r, 1),
        parents=torch.full((r, 1), -1, dtype=torch.long, device=dev),
        depths=torch.zeros((r, 1), dtype=torch.long, device=dev),
        valid=torch.ones((r, 1), dtype=torch.bool, device=dev),
        visibility=torch.ones((r, 1, 1), dtype=torch.bool, device=dev),
        scores=torch.zeros((r, 1), dtype=torch.float32, device=dev),
    )


class ModelRunner:
    """Owns the models and their KV caches; runs prefill chunks and speculative rounds."""

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        *,
        slots: int,
        cache_len: int,
        kernels: KernelSet,
    ) -> None:
        """kernels: which ops run their Triton kernel (:class:`~ddtree.engine.kernels.KernelSet`, resolved once
        from the config and the models by :func:`ddtree.engine.build.build`); passed down to every call."""
        self.target = target
        self.drafter = drafter
        self.kernels = kernels
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.target_cache: KVCache = target.allocate_cache(slots, cache_len)
        self.drafter_cache: KVCache | None = drafter.allocate_cache(slots, cache_len) if drafter is not None else None
        self.feature_layers: tuple[int, ...] = (
            tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        )

    @property
    def tree_kernel(self) -> bool:
        """Whether the verify and prefill attend through the tree-attention kernel (no dense mask)."""
        return self.kernels.tree_attention

    @property
    def kv_bytes(self) -> int:
        return self.target_cache.nbytes + (self.drafter_cache.nbytes if self.drafter_cache is not None else 0)

    # ---- prefill ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, inp: PrefillInputs, *, every_position: bool = False) -> Tensor:
        """Write a causal prompt chunk into both caches; return the target's logits at each row's last token.

        Returns ``[R, V]`` float logits; with ``every_position`` (prompt log-probs, only for chunks with a row that
        asked: the output projection then runs over every token) ``[R, T, V]``, the logits at every column."""
        positions, seen = self._chunk_view(inp)
        out = self.target(
            inp.ids,
            positions,
            self.target_cache,
            inp.slots,
            positions,
            seen,
            kernels=self.kernels,
            logits_at=None if every_position else inp.last_index[:, None],
            hidden_layers=self.feature_layers,
        )
        if self.drafter is not None:
            # Padding columns write features past the prompt; they stay invisible (beyond every ctx_len) and are
            # overwritten when those positions are committed.
            self.drafter.append_context(out.hidden, positions, self.drafter_cache, inp.slots, positions,
                                        kernels=self.kernels)
        return out.logits if every_position else out.logits[:, 0]

    def _chunk_view(self, inp: PrefillInputs) -> tuple[Tensor, Tensor | TreeVisibility]:
        """A prompt chunk's positions ``[R, T]`` (= its cache indices) and visibility: the tree kernel takes a causal
        chunk as a tree whose every node sees the ones before it (and skips the keys after a query tile's last
        token); the dense path gets its mask. A chunk never branches (exact mode does not group its queries' tail
        tiles: batch_invariant.tail_chunks)."""
        t = inp.ids.shape[1]
        positions = inp.start[:, None] + torch.arange(t, device=self.device)
        visibility = speculative.causal_visibility(t, inp.valid_len)
        if self.kernels.tree_attention:
            return positions, TreeVisibility(inp.start, visibility, inp.kv_len, branches=False)
        return positions, speculative.build_attention_mask(inp.start, positions, visibility, inp.kv_len)

    # ---- one speculative round, as four stages ------------------------------------------------------------------
    # Each stage reads the round's inputs and the earlier stages' typed outputs from a RoundWork and fills its own
    # field there, so the CUDA-graph runner (ddtree.engine.cuda_graphs) can capture each stage as its own graph and
    # time it with events between replays.

    STAGES = ("draft", "tree", "verify", "commit")

    def stages(self) -> tuple[tuple[str, Callable[[RoundInputs, RoundWork], None]], ...]:
        """The four stages in order, by name."""
        return (("draft", self.stage_draft), ("tree", self.stage_tree), ("verify", self.stage_verify),
                ("commit", self.stage_commit))

    def drafts(self, inp: RoundInputs) -> bool:
        """Whether the draft stage does any work for this round (:attr:`RoundShape.drafts` and there is a drafter);
        the graph runner skips capturing an empty stage (CUDA warns on an empty graph)."""
        return self.drafter is not None and inp.shape.drafts

    def stage_draft(self, inp: RoundInputs, work: RoundWork) -> None:
        if self.drafts(inp):
            work.draft_hidden = self.drafter.draft_hidden(
                self.target,
                inp.root_token,
                inp.start,
                self.drafter_cache,
                inp.slot,
                inp.shape.block_size,
                block_len=inp.depth_limit + 1,
                window=inp.window,
                kv_len=inp.shape.draft_kv_len,
                kernels=self.kernels,
            )

    def stage_tree(self, inp: RoundInputs, work: RoundWork) -> None:
        shape = inp.shape
        expected = None
        if work.draft_hidden is not None:
            # the head only at the depths a tree of this round can reach (RoundShape.draft_depths); an auto round
            # selects auto_width nodes for every row (its expected lengths), then verifies the first max_budget,
            # each row cut at its own budget: the same tree as a build at max_budget
            draft_logits = self.drafter.head(self.target, work.draft_hidden[:, : shape.draft_depths])
            wide = shape.auto_width > shape.max_budget
            trees = speculative.build_trees(
                draft_logits,
                shape.auto_width if wide else inp.budget,
                inp.topk,
                max_budget=shape.auto_width if wide else shape.max_budget,
                depth_limit=inp.depth_limit,
                root_tokens=inp.root_token,
                fast_topk=self.kernels.vocab_topk,
                fast_select=self.kernels.tree_select,
            )
            if shape.auto_width:
                expected = tree_select.expected_lengths(trees.scores)
                trees = tree_select.prefix_trees(trees, shape.max_budget + 1, inp.budget)
        else:
            trees = root_only_trees(inp.root_token)
        n = trees.tokens.shape[1]
        write_pos = speculative.tree_write_positions(inp.start, n)
        # With KernelSet.tree_attention the verify attends through the Triton tree kernel, which reads (start,
        # visibility) directly; the dense path needs the [R, N, kv_len] mask.
        if self.kernels.tree_attention:
            seen: Tensor | TreeVisibility = TreeVisibility(inp.start, trees.visibility, shape.kv_len)
        else:
            seen = speculative.build_attention_mask(inp.start, write_pos, trees.visibility, shape.kv_len)
        work.tree = TreeStage(trees=trees, positions=speculative.tree_positions(inp.start, trees.depths),
                              write_pos=write_pos, visibility=seen, expected=expected)

    def stage_verify(self, inp: RoundInputs, work: RoundWork) -> None:
        """The target over the trees, then its choice at each node: :meth:`stage_forward`, :meth:`stage_choose`."""
        self.stage_forward(inp, work)
        self.stage_choose(inp, work)

    def stage_forward(self, inp: RoundInputs, work: RoundWork) -> None:
        """The verify's layers (no head): features for the drafter and the final-normed states at every node. A
        round with a prompt chunk (``inp.prefill``, a mixed round) runs the chunk's rows in the same forward
        (:meth:`~ddtree.models.target.TargetModel.forward_segments`) and writes their drafter context here, as
        :meth:`prefill` does."""
        tree = work.tree
        trees = tree.trees
        if inp.prefill is not None:
            self._forward_mixed(inp, work)
            return
        out = self.target(
            trees.tokens,
            tree.positions,
            self.target_cache,
            inp.slot,
            tree.write_pos,
            tree.visibility,
            kernels=self.kernels,
            hidden_layers=self._round_feature_layers(inp),
            head=False,
        )
        work.verify = VerifyStage(hidden=out.hidden, normed=out.normed)

    def _forward_mixed(self, inp: RoundInputs, work: RoundWork) -> None:
        tree, chunk = work.tree, inp.prefill
        positions, seen = self._chunk_view(chunk)
        # the drafter reads every chunk's features (a prefilling request may draft), whatever the trees' rows do
        layers = self.feature_layers
        rounds, prompts = self.target.forward_segments(
            [Segment(tree.trees.tokens, tree.positions, inp.slot, tree.write_pos, tree.visibility, None),
             Segment(chunk.ids, positions, chunk.slots, positions, seen, chunk.last_index[:, None])],
            self.target_cache, kernels=self.kernels, hidden_layers=layers)
        if self.drafter is not None:
            self.drafter.append_context(prompts.hidden, positions, self.drafter_cache, chunk.slots, positions,
                                        kernels=self.kernels)
        work.verify = VerifyStage(hidden=rounds.hidden if self._round_feature_layers(inp) else None,
                                  normed=rounds.normed, prompt_normed=prompts.normed)

    def stage_choose(self, inp: RoundInputs, work: RoundWork) -> None:
        """The head's logits at every node (the same bits as a forward with its head), min_tokens' masking, and
        the target's token at each node: the argmax, or a sample."""
        verify = work.verify
        logits = self.target.head_logits(verify.normed, kernels=self.kernels)
        depth_steps = inp.step[:, None] + work.tree.trees.depths  # output index each node's choice would commit
        chosen_from = logits
        if inp.shape.min_tokens:
            chosen_from = mask_min_tokens(logits, inp.banned, inp.min_tokens, depth_steps)
        if inp.shape.greedy:
            verify.choices = chosen_from.argmax(dim=-1)
        else:
            verify.choices = speculative.sample_choices(chosen_from, inp.temperature, inp.top_p, inp.top_k, inp.seed,
                                                        depth_steps, any_filter=inp.shape.filtered)
        verify.logits = logits if inp.shape.logprobs else None
        if verify.prompt_normed is not None:  # a mixed round: the target's logits at each chunk's last token
            work.first_logits = self.chunk_logits(verify.prompt_normed)

    @torch.inference_mode()
    def chunk_logits(self, prompt_normed: Tensor) -> Tensor:
        """A mixed round's logits ``[P, V]`` at each chunk row's last token from its final-normed states
        ``[P, 1, H]`` (the same head as a prefill step's)."""
        return self.target.head_logits(prompt_normed, kernels=self.kernels)[:, 0]

    def stage_commit(self, inp: RoundInputs, work: RoundWork) -> None:
        max_depth = inp.shape.block_size - 1 if work.draft_hidden is not None else 0
        walk = speculative.walk_trees(work.tree.trees, work.verify.choices, max_depth, kernel=self.kernels.walk)
        for cache in (self.target_cache.k, self.target_cache.v):
            speculative.compact_cache(cache, inp.slot, inp.start, walk.path, contiguous=inp.shape.contiguous,
                               kernel=self.kernels.compaction)
        hidden = work.verify.hidden  # [R, N, F]
        if hidden is not None:
            feats = torch.gather(hidden, 1, walk.path[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [R, L+1, F]
            ctx_pos = inp.start[:, None] + torch.arange(walk.path.shape[1], device=self.device)
            self.drafter.append_context(feats, ctx_pos, self.drafter_cache, inp.slot, ctx_pos, kernels=self.kernels)
        # One tensor for the host to read (one copy, one sync): the accepted count, then the committed tokens, then
        # (rounds with log-probs) the target's log-probs at the accepted nodes (ddtree.engine.logprobs).
        parts = [walk.num_accepted[:, None], walk.new_tokens]
        if work.verify.logits is not None:
            parts.append(pack_round_logprobs(work.verify.logits, walk.path, walk.new_tokens))
        if work.tree.expected is not None:  # auto: the accepted path (node indices), then E(1 .. W)
            parts.append(walk.path)
            parts.append(float_bits(work.tree.expected))
        work.result = torch.cat(parts, 1)

    def _round_feature_layers(self, inp: RoundInputs) -> tuple[int, ...]:
        """Target layers whose features the drafter needs after this round: none when no row drafts in its lifetime
        (:attr:`RoundShape.keeps_context`; an auto round at budget 0 drafts nothing now but keeps them).

        Why: a request's method is fixed for its lifetime, so an AR row never reads its drafter context; a batch of
        AR rows skips the feature copy and the drafter's context projection (0.36 ms a round on the stand-in)."""
        return self.feature_layers if inp.shape.keeps_context else ()

    @torch.inference_mode()
    def round(self, inp: RoundInputs, timer: StageTimer, work: RoundWork | None = None) -> Tensor:
        """Draft, build trees, verify, walk and commit for every row (eager). Returns the device tensor
        ``[R, 1 + L + 1]``: per row the number of tokens committed this round (bonus included), then the
        committed tokens (``walk_trees``' ``new_tokens``; entries past that number are padding). ``work``: the
        caller's record of the stages' outputs (a mixed round's caller reads its ``first_logits``)."""
        work = RoundWork() if work is None else work
        for name, stage in self.stages():
            with timer.stage(name):
                stage(inp, work)
        return work.result

    @torch.inference_mode()
    def sample_first(self, logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor,
                     greedy: bool, filtered: bool = True, min_tokens: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The first completion token of each row from its prefill logits ``[R, V]`` -> ``[R]``.

        min_tokens: ``(banned [B, R], min_tokens [R])`` when some row has min_tokens > 0 (its banned ids are masked:
        the first token is output index 0)."""
        step = torch.zeros_like(seed)[:, None]  # the first completion token is output index 0
        if min_tokens is not None:
            logits = mask_min_tokens(logits[:, None, :], min_tokens[0], min_tokens[1], step)[:, 0]
        if greedy:
            return logits.argmax(dim=-1)
        return speculative.sample_choices(logits[:, None, :], temperature, top_p, top_k, seed, step,
                                   any_filter=filtered)[:, 0]


def to_host(*tensors: Tensor) -> list[list]:
    """The one place a round's results cross to the host (a single synchronising copy per tensor)."""
    return [t.tolist() for t in tensors]


class HostCopy:
    """A device tensor's copy to the host, started now and read later (the engine starts it right after queuing a
    round and reads it when it needs the tokens, possibly after queuing the next round, whose replay overwrites the
    device tensor: the copy is ordered before that on the stream). On a CPU it is a clone."""

    def __init__(self, tensor: Tensor) -> None:
        self._event = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # CPU ops are synchronous: nothing to wait for; a clone, as the tensor may be a buffer that the next
            self._host = tensor.clone()  # queued round writes (CUDA graphs emulated on a CPU, in the tests)

    def get(self) -> list:
        """The values as nested lists (waits for the copy: the round's one host sync)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
