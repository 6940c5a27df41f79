"""RoundGraphs' stage sharing, on a CPU: what a capture may touch, eviction, and a failed capture.

Real graphs need CUDA (tests/engine/test_cuda_graphs.py replays them against eager rounds on a GPU). Here a stand-in
recorder runs each stage eagerly where a capture would record it and records what it saw, so the bookkeeping of
``cuda_graphs.RoundGraphs`` is checked without a device: every eager pass, recording and replay a capture runs sees
padding rows only (never a served round's live slots), shared stages are counted and dropped with their last key,
and a capture that fails leaves no shared stage behind.
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.cuda_graphs import RoundGraphs, stage_key
from ddtree.engine.kernels import KernelSet
from ddtree.engine.round import PackedRows, RoundShape, RowInputs
from ddtree.engine.runner import ModelRunner, StageTimer


class _Graph:
    def __init__(self, recorder: _Recorder, fn) -> None:
        self.recorder, self.fn = recorder, fn

    def replay(self) -> None:
        if self.recorder.capturing:
            self.recorder.check("replay")
        self.fn()


class _Recorder:
    """Runs what it would capture; checks that the graphs' inputs hold padding rows whenever a capture runs."""

    def __init__(self) -> None:
        self.graphs: RoundGraphs | None = None
        self.capturing = False
        self.seen: list[str] = []
        self.fail_stage: str | None = None
        self.signatures: list = []

    def make_room(self) -> None:
        self.capturing = True  # RoundGraphs._capture starts here

    def check(self, what: str) -> None:
        self.seen.append(what)
        scratch = self.graphs.scratch
        for front in self.graphs.fronts.values():
            slots = front.packed.field("slot")
            assert slots.eq(scratch).all(), f"{what} ran over live slots {slots.tolist()}"

    def warm_up(self, fn, signature=None) -> None:
        self.check("eager")
        fn()

    def record(self, fn, pool, *, stage: str = "graph", signature=None):
        self.check(f"record {stage}")
        if stage == self.fail_stage:
            raise RuntimeError(f"capture of {stage} failed")
        out = fn()
        return _Graph(self, fn), out

    def record_stages(self, eager, stages, pool, *, signature):
        self.signatures.append(signature)
        self.warm_up(eager, signature)
        return [self.record(fn, pool, stage=stage, signature=signature) for stage, fn in stages]


@pytest.fixture
def graphs(tiny_pair, monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    target, drafter = tiny_pair
    runner = ModelRunner(target, drafter, slots=5, cache_len=96, kernels=KernelSet.torch())
    recorder = _Recorder()
    g = RoundGraphs(runner, max_rows=4, cache_len=96, max_graphs=3, recorder=recorder)
    recorder.graphs = g
    return g


def _key(*, budget: int = 4, greedy: bool = True, kv_len: int = 64) -> RoundShape:
    return RoundShape(rows=2, max_budget=budget, block_size=8, kv_len=kv_len, draft_kv_len=kv_len, greedy=greedy,
                      filtered=False, contiguous=False)


def _live_rows() -> PackedRows:
    rows = [RowInputs(slot=s, root_token=5 + s, start=10 + s, budget=4, topk=2, depth_limit=7, window=1 << 30,
                      top_k=0, seed=s, step=3, min_tokens=0, temperature=0.0, top_p=1.0) for s in (1, 2)]
    return PackedRows.pack(rows)


def test_a_capture_that_reuses_a_served_front_runs_on_padding_rows(graphs):
    """A round of live rows leaves them in the shared front's inputs; the next key's capture (same draft key, a
    sampled variant, and another node bucket) must reset them before any eager pass, recording or replay."""
    greedy = _key()
    graphs.capture(greedy)
    graphs.recorder.capturing = False
    graphs.run(_live_rows(), greedy, StageTimer(torch.device("cpu")))
    front = graphs.fronts[stage_key(greedy, "draft")]
    assert front.packed.field("slot").tolist() == [1, 2]  # the served rows stay in the front's inputs
    graphs.recorder.seen.clear()
    for key in (_key(greedy=False), _key(budget=8)):
        graphs.capture(key)
        graphs.recorder.capturing = False
    assert "replay" in graphs.recorder.seen and "record choose" in graphs.recorder.seen
    assert len(graphs.fronts) == 1 and len(graphs.trees) == 2  # one draft key; node buckets 4 and 8
    assert graphs.stage_graphs() == {"draft": 1, "tree": 2, "forward": 2, "choose": 3, "commit": 3}


def test_shared_stages_go_with_their_last_key(graphs):
    """max_graphs 3: a fourth key evicts the first; its tree (used by no other key) goes, the front stays."""
    keys = [_key(), _key(greedy=False), _key(budget=8), _key(budget=8, greedy=False)]
    for key in keys:
        graphs.capture(key)
    assert list(graphs.graphs) == keys[1:]
    assert graphs.fronts[stage_key(keys[0], "draft")].users == 3
    assert graphs.trees[stage_key(keys[1], "tree")].users == 1
    assert graphs.trees[stage_key(keys[2], "tree")].users == 2
    for key in keys[1:]:
        graphs.graphs.pop(key)
        graphs._drop(key)
    assert graphs.fronts == {} and graphs.trees == {}


@pytest.mark.parametrize("stage", ["forward", "choose", "commit"])
def test_a_failed_capture_leaves_no_shared_stage_behind(graphs, stage):
    """A stage's recording fails: the front and tree made for the key are gone, nothing counts a user, and
    the next capture of the same key works."""
    graphs.recorder.fail_stage = stage
    with pytest.raises(RuntimeError, match=f"capture of {stage} failed"):
        graphs.capture(_key())
    assert graphs.graphs == {} and graphs.fronts == {} and graphs.trees == {}
    graphs.recorder.fail_stage = None
    graphs.capture(_key())
    assert graphs.fronts[stage_key(_key(), "draft")].users == 1 and len(graphs.graphs) == 1


def test_eager_signatures_leave_out_the_key_lengths(graphs):
    """Keys that differ only in their cache lengths share every eager-pass signature (their kernels differ at most in
    the attention's launch, whose first use a retry covers), and a different node bucket does not."""
    for kv_len in (64, 80):
        graphs.capture(_key(kv_len=kv_len))
    first, second = graphs.recorder.signatures[:3], graphs.recorder.signatures[3:6]
    assert len(graphs.trees) == 2 and len(graphs.fronts) == 2  # two keys' own shared stages ...
    assert first == second  # ... under the same signatures
    graphs.capture(_key(budget=8))  # reuses the first key's front: the layers' and the choice's signatures only
    assert len(graphs.recorder.signatures) == 8 and graphs.recorder.signatures[6][0] == "forward"
    assert graphs.recorder.signatures[6] != first[1]  # the layers' signature follows the node bucket
