"""Recorder.record_stages on a CPU: eager passes once per signature, and a retry when a capture of a known
signature fails (a first use the signature did not foresee). Real captures need CUDA (tests/engine/test_cuda_graphs.py
and tests/engine/test_warmup_gpu.py run them); here recording is a stand-in that can be told to fail."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.graph_capture import Recorder


class _Recorder(Recorder):
    """Eager passes and recordings logged; ``fail`` names (stage, attempt) pairs whose recording raises."""

    def __init__(self, eager_runs: int = 1) -> None:
        super().__init__(torch.device("cpu"), eager_runs=eager_runs)
        self.log: list[str] = []
        self.fail: set[tuple[str, int]] = set()
        self.attempts: dict[str, int] = {}

    def _eager(self, fn) -> None:
        self.log.append("eager")
        fn()

    def record(self, fn, pool, *, stage: str = "graph", signature=None):
        n = self.attempts[stage] = self.attempts.get(stage, 0) + 1
        self.log.append(f"record {stage}")
        if (stage, n) in self.fail:  # the real record also forgets the signature; record_stages must not rely on it
            raise RuntimeError(f"operation not permitted when stream is capturing ({stage})")
        return object(), fn()


def _stages(*names: str):
    return [(name, lambda name=name: name) for name in names]


def test_eager_passes_once_per_signature():
    rec = _Recorder()
    assert [out for _, out in rec.record_stages(lambda: None, _stages("tree", "forward"), None, signature="a")] == [
        "tree", "forward"]
    rec.record_stages(lambda: None, _stages("tree", "forward"), None, signature="a")
    rec.record_stages(lambda: None, _stages("tree"), None, signature="b")
    assert rec.log == ["eager", "record tree", "record forward", "record tree", "record forward", "eager",
                       "record tree"]


def test_a_failed_capture_of_a_known_signature_warms_up_and_retries_once():
    rec = _Recorder()
    rec.record_stages(lambda: None, _stages("tree", "forward"), None, signature="a")
    rec.log.clear()
    rec.fail = {("forward", 2)}  # the second key's forward meets a first use
    outs = rec.record_stages(lambda: None, _stages("tree", "forward"), None, signature="a")
    assert [out for _, out in outs] == ["tree", "forward"]
    assert rec.log == ["record tree", "record forward", "eager", "record forward"]
    assert rec.clock.counts["retry"] == 1
    rec.log.clear()
    rec.record_stages(lambda: None, _stages("tree"), None, signature="a")  # warmed again by the retry
    assert rec.log == ["record tree"]


def test_a_failure_after_eager_passes_is_raised():
    rec = _Recorder()
    rec.fail = {("tree", 1)}
    with pytest.raises(RuntimeError, match="capturing"):
        rec.record_stages(lambda: None, _stages("tree"), None, signature="a")
    rec.fail = {("tree", 3), ("tree", 4)}  # known signature: fails, warms up, fails again
    rec.record_stages(lambda: None, _stages("tree"), None, signature="a")
    with pytest.raises(RuntimeError, match="capturing"):
        rec.record_stages(lambda: None, _stages("tree"), None, signature="a")


def test_without_eager_passes_a_failure_is_raised():
    rec = _Recorder(eager_runs=0)
    rec.fail = {("tree", 1)}
    with pytest.raises(RuntimeError):
        rec.record_stages(lambda: None, _stages("tree"), None, signature="a")
    assert "eager" not in rec.log


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_while_a_graph_records_and_restored_after(enabled_before):
    """A collection inside a capture could free an older graph there (the driver refuses that while a stream
    captures): the collector is off inside, and left as it was found after, also when the recording raises."""
    import gc

    from ddtree.engine.graph_capture import _no_collection

    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with _no_collection():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled_before
        with pytest.raises(RuntimeError), _no_collection():
            raise RuntimeError("capture invalidated")
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()
