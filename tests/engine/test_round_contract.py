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
