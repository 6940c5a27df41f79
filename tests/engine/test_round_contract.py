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
        value = getattr(self._shape, name)
        self.read.add("block_size" if name == "drafts" else name)  # drafts is block_size > 1
        return value


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
    for auto_width in (0, 7):
        shape = RoundShape(rows=2, max_budget=3, block_size=8, kv_len=20, draft_kv_len=20, greedy=False,
                           filtered=True, contiguous=False, logprobs=True, min_tokens=True, auto_width=auto_width)
        logs = {}
        work = RoundWork()
        for name, stage in (("draft", runner.stage_draft), ("tree", runner.stage_tree),
                            ("forward", runner.stage_forward)):
            logs[name] = _ReadLog(shape)
            stage(RoundInputs.from_packed(PackedRows.pack(rows), logs[name]), work)
        assert work.draft_logits is not None and work.tree is not None and work.verify.normed is not None
        for name, log in logs.items():
            assert log.read - {"rows"} <= set(STAGE_SHAPE_FIELDS[name]), (name, log.read)
        assert "draft_kv_len" in logs["draft"].read and "max_budget" in logs["tree"].read
