"""Helpers shared by the engine's tests."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ddtree.engine import GenerationRequest


def submit_staggered(engine, requests: Sequence[GenerationRequest], gap: float | Callable[[int], float] = 0.03, *,
                     timeout: float = 120.0) -> list[list[int]]:
    """Submit ``requests`` one by one, ``gap`` seconds (or ``gap(i)`` after request i) apart, so each arrives while
    the earlier ones decode; wait for all of them -> each one's completion tokens, in order. Every request must end
    with finish reason "length" and no error (checked once all are done, not inside the engine's callback, where a
    failed assert would only cancel that request)."""
    results: dict[int, list[int]] = {}
    reasons: dict[int, tuple] = {}
    done = threading.Event()
    for i, req in enumerate(requests):
        toks: list[int] = []

        def on_chunk(ch, i=i, toks=toks):
            toks.extend(ch.token_ids)
            if ch.finished:
                results[i] = toks
                reasons[i] = (ch.finish_reason, ch.error)
                if len(results) == len(requests):
                    done.set()

        engine.submit(req, on_chunk)
        time.sleep(gap(i) if callable(gap) else gap)
    assert done.wait(timeout), f"{len(results)} of {len(requests)} requests finished"
    assert all(r == ("length", None) for r in reasons.values()), reasons
    return [results[i] for i in range(len(requests))]


def plain_greedy(target, prompt_ids: list[int], n: int) -> list[int]:
    """The engine's reference: full recompute with ``forward_train`` at every step, argmax (no cache, no trees)."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(target.forward_train(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


# ---- CUDA graphs emulated on a CPU ----------------------------------------------------------------------------------

def copy_into(old, new) -> None:
    """Write ``new``'s tensors into ``old``'s (same structure): what a CUDA graph's replay does to its outputs."""
    if isinstance(old, torch.Tensor):
        assert isinstance(new, torch.Tensor) and old.shape == new.shape
        old.copy_(new)
    elif dataclasses.is_dataclass(old):
        for f in dataclasses.fields(old):
            copy_into(getattr(old, f.name), getattr(new, f.name))
    elif isinstance(old, tuple):
        for a, b in zip(old, new, strict=True):
            copy_into(a, b)
    else:
        assert old == new, (old, new)


class EmulatedReplays:
    """CUDA graphs on a CPU: a "graph" reruns the function it recorded, and while it replays, a stage output it
    assigns (a RoundWork, TreeStage or VerifyStage field already holding one) is copied into the tensors it held
    at the recording instead, as a real replay writes into the memory it captured. What this cannot show is the
    device's memory (a tensor the graph reads that nothing keeps alive; the GPU tests cover that)."""

    def __init__(self, monkeypatch) -> None:
        from ddtree.engine import round as rnd

        self.replaying = False
        for cls in (rnd.RoundWork, rnd.TreeStage, rnd.VerifyStage):
            monkeypatch.setattr(cls, "__setattr__", self._setter())

    def _setter(self):
        def setattr_(obj, name, value):
            current = obj.__dict__.get(name)
            if self.replaying and current is not None and value is not None:
                copy_into(current, value)
            else:
                object.__setattr__(obj, name, value)

        return setattr_

    def make_room(self) -> None:
        pass

    def warm_up(self, fn, signature=None) -> bool:
        fn()
        return True

    def record(self, fn, pool, *, stage: str = "graph", signature=None):
        recorder = self

        class Graph:
            def replay(self) -> None:
                recorder.replaying = True
                try:
                    fn()
                finally:
                    recorder.replaying = False

        return Graph(), fn()

    def record_stages(self, eager, stages, pool, *, signature):
        eager()
        return [self.record(fn, pool, stage=stage) for stage, fn in stages]


def emulate_graphs(engine, monkeypatch, *, max_rows: int, max_chunk_width: int = 16) -> None:
    """Make ``engine``'s rounds replay CUDA graphs emulated on the CPU (:class:`EmulatedReplays`), batches of up to
    ``max_rows`` requests (the engine's ``max_batch`` at most)."""
    from ddtree.engine.cuda_graphs import RoundGraphs

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(RoundGraphs, "can_run", lambda self, rows: rows <= self.max_rows)
    engine.graphs = RoundGraphs(engine.runner, max_rows=max_rows, cache_len=engine.cache_len,
                                recorder=EmulatedReplays(monkeypatch), max_chunk_width=max_chunk_width)
