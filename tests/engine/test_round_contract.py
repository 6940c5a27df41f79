"""The round contract (ddtree.engine.round): the row record fixes the packing order, and the graph key is a shape."""

from __future__ import annotations

import dataclasses

import torch

from ddtree.engine.api import MAX_STOP_IDS
from ddtree.engine.cuda_graphs import graph_key
from ddtree.engine.round import FLOAT_FIELDS, LONG_FIELDS, PackedRows, RoundInputs, RoundShape, RowInputs


def _row(i: int) -> RowInputs:
    return RowInputs(slot=i, root_token=10 + i, start=20 + i, budget=3, topk=2, depth_limit=7, window=99, top_k=5,
                     seed=1000 + i, step=4 + i, min_tokens=6 + i, temperature=0.5 + i, top_p=0.75,
                     banned=tuple(range(i + 1)))


def test_every_row_field_reaches_the_round_inputs_tensor_of_its_own_name():
    rows = [_row(0), _row(1), _row(2)]
    shape = RoundShape(rows=3, max_budget=3, block_size=8, kv_len=30, draft_kv_len=22, greedy=False, filtered=True,
                       contiguous=False)
    inp = RoundInputs.from_packed(PackedRows.pack(rows), shape)
    for f in dataclasses.fields(RowInputs):
        if f.name != "banned":
            assert getattr(inp, f.name).tolist() == [getattr(r, f.name) for r in rows], f.name
    # the banned ids: MAX_STOP_IDS rows after the long fields, -1 past each row's own
    assert inp.banned.T.tolist() == [list(r.banned) + [-1] * (MAX_STOP_IDS - len(r.banned)) for r in rows]
    assert set(LONG_FIELDS) | set(FLOAT_FIELDS) | {"banned"} == {f.name for f in dataclasses.fields(RowInputs)}
    assert inp.shape is shape


def test_advanced_rows_take_the_last_committed_token_and_move_by_the_count():
    packed = PackedRows.pack([_row(0), _row(1)])
    # row 0 commits 2 tokens (7, 8), row 1 commits 1 (9)
    result = torch.tensor([[2, 7, 8, 0], [1, 9, 0, 0]])
    nxt = packed.advanced(result)
    assert nxt.field("root_token").tolist() == [8, 9]
    assert nxt.field("start").tolist() == [22, 22]
    assert nxt.field("step").tolist() == [6, 6]
    assert nxt.field("seed").tolist() == [1000, 1001] and packed.field("root_token").tolist() == [10, 11]


def test_graph_key_is_the_shape_rounded_up():
    shape = RoundShape(rows=3, max_budget=9, block_size=16, kv_len=1300, draft_kv_len=1290, greedy=True,
                       filtered=False, contiguous=False)
    key = graph_key(shape, max_rows=8, cache_len=4096)
    assert key == RoundShape(rows=4, max_budget=15, block_size=16, kv_len=2048, draft_kv_len=2048, greedy=True,
                             filtered=False, contiguous=False)
    assert graph_key(key, max_rows=8, cache_len=4096) == key  # a key is its own bucket


class _ReadLog:
    """A RoundShape stand-in that records which fields a stage reads."""

    def __init__(self, shape: RoundShape) -> None:
        self._shape, self.read = shape, set()

    def __getattr__(self, name: str):
        from ddtree.engine.runner import STAGE_SHAPE_FIELDS

        prop = getattr(RoundShape, name, None)
        keyed = any(name in fields for fields in STAGE_SHAPE_FIELDS.values())
        if isinstance(prop, property) and not keyed:  # a derived size (draft_depths): record the fields it reads
            return prop.fget(self)
        self.read.add(name)
        return getattr(self._shape, name)


def test_the_draft_and_tree_stages_read_only_their_declared_shape_fields(tiny_pair):
    """cuda_graphs.RoundGraphs shares the draft, tree and verify-layers graphs among keys equal on
    STAGE_SHAPE_FIELDS; a stage reading any other field would replay the wrong graph for some key. Both an auto
    round and a plain tree round, with every flag the forward must not read (sampling, log-probs, min_tokens) on."""
    from ddtree.engine.kernels import KernelSet
    from ddtree.engine.round import RoundWork
    from ddtree.engine.runner import STAGE_SHAPE_FIELDS, ModelRunner

    target, drafter = tiny_pair
    runner = ModelRunner(target, drafter, slots=3, cache_len=64, kernels=KernelSet.torch())
    rows = [dataclasses.replace(_row(i), slot=i, root_token=3 + i, start=4 + i, window=99) for i in range(2)]
    for budget, auto_width in ((3, 0), (3, 7), (0, 1)):  # (0, 1): an auto round at budget 0 (no draft)
        shape = RoundShape(rows=2, max_budget=budget, block_size=8, kv_len=20, draft_kv_len=20, greedy=False,
                           filtered=True, contiguous=False, logprobs=True, min_tokens=True, auto_width=auto_width)
        logs = {}
        work = RoundWork()
        for name, stage in (("draft", runner.stage_draft), ("tree", runner.stage_tree),
                            ("forward", runner.stage_forward)):
            logs[name] = _ReadLog(shape)
            stage(RoundInputs.from_packed(PackedRows.pack(rows), logs[name]), work)
        assert (work.draft_hidden is not None) == (budget > 0) and work.tree is not None
        assert work.verify.normed is not None and work.verify.hidden is not None  # the drafter's context is kept
        for name, log in logs.items():
            assert log.read - {"rows"} <= set(STAGE_SHAPE_FIELDS[name]), (name, log.read)
        assert "drafts" in logs["draft"].read  # whether it drafts, then (only then) its sizes
        assert ("draft_kv_len" in logs["draft"].read) == ("max_budget" in logs["tree"].read) == (budget > 0)


def test_the_tree_stage_heads_only_the_reachable_depths_and_builds_the_full_heads_trees(tiny_pair):
    """The draft stage hands the tree stage the drafter's states, and the head runs only at the depths a tree of the
    round can reach (RoundShape.draft_depths: a tree of B nodes is at most B deep). The trees must equal those built
    from the head over the whole block (the drafter's own draft_logits), for a fixed budget below the block, an auto
    width above the budget, and a budget past the block (every depth)."""
    from ddtree import speculative
    from ddtree.engine.kernels import KernelSet
    from ddtree.engine.round import RoundWork
    from ddtree.engine.runner import ModelRunner
    from ddtree.speculative import tree_select

    target, drafter = tiny_pair
    runner = ModelRunner(target, drafter, slots=3, cache_len=64, kernels=KernelSet.torch())
    torch.manual_seed(0)
    ctx = torch.randn(3, 20, drafter.config.feature_size)
    pos = torch.arange(20).expand(3, -1)
    drafter.append_context(ctx, pos, runner.drafter_cache, torch.arange(3), pos)
    for block, budget, auto_width, depths in ((8, 3, 0, 3), (8, 3, 7, 7), (8, 12, 0, 7), (16, 3, 7, 7),
                                              (16, 1, 3, 3), (16, 4, 0, 4)):
        rows = [dataclasses.replace(_row(i), slot=i, root_token=3 + i, start=12 + i, budget=budget, topk=0,
                                    depth_limit=block - 1, window=99) for i in range(3)]
        shape = RoundShape(rows=3, max_budget=budget, block_size=block, kv_len=40, draft_kv_len=20, greedy=True,
                           filtered=False, contiguous=False, auto_width=auto_width)
        assert shape.draft_depths == depths
        inp = RoundInputs.from_packed(PackedRows.pack(rows), shape)
        work = RoundWork()
        runner.stage_draft(inp, work)
        runner.stage_tree(inp, work)
        assert work.draft_hidden.shape[1] == block - 1
        full = drafter.draft_logits(target, inp.root_token, inp.start, runner.drafter_cache, inp.slot, block,
                                    block_len=inp.depth_limit + 1, window=inp.window, kv_len=20)  # [R, L, V]
        width = max(budget, auto_width)
        ref = speculative.build_trees(full, width if auto_width else inp.budget, inp.topk, max_budget=width,
                                      depth_limit=inp.depth_limit, root_tokens=inp.root_token)
        if auto_width:
            expected = tree_select.expected_lengths(ref.scores)
            torch.testing.assert_close(work.tree.expected, expected)
            ref = tree_select.prefix_trees(ref, budget + 1, inp.budget)
        got = work.tree.trees
        for field in ("tokens", "parents", "depths", "valid", "visibility"):
            assert torch.equal(getattr(got, field), getattr(ref, field)), (block, budget, auto_width, field)
        torch.testing.assert_close(got.scores, ref.scores)
