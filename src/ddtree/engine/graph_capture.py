"""Recording CUDA graphs at start-up speed: one eager pass before a capture, no per-capture cache flush, and a clock.

Why not ``torch.cuda.graph`` as is: each use synchronises the device, empties torch's device cache and its pinned
host cache, then captures. A round key is four stage graphs, so a warm-up of a thousand keys paid four
synchronisations and four cache flushes a key, and every flush handed the eager pass's transient blocks back to the
driver, to be allocated again by the next key's eager pass (``cudaFree`` synchronises too). On the H200 stand-in
that was about 0.125 s a key with two eager passes each (docs/benchmarks.md, "Start-up warm-up"). Here a capture is
``capture_begin`` / ``capture_end`` on one capture stream, the device cache is emptied only when free memory runs
low (:meth:`Recorder.make_room`), and the eager pass PyTorch asks for (lazy initialisation, Triton compilation and
module loading must not happen inside a capture) runs only for a capture that raised, which is then retried
(``eager_runs`` 0, the default), or a fixed number of times before every capture. Why 0: on the H200 stand-in
re-capturing 40 round keys took 87 ms a key with two eager passes, 57 with one and 31 with none (the recording
itself, about 38 ms of it for the 36-layer forward); the engine's start-up precompiles the tree-attention variants
(``ddtree.engine.precompile``), and whatever still needs a first eager run makes its capture fail and retry.

:class:`CaptureClock` adds up where the time goes (eager passes, recording per stage, cache flushes) so that
``Engine.info()["warmup"]["capture"]`` and the start-up benchmark can say it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")

LOW_FREE_BYTES = 2 << 30  # below this much free device memory a capture first empties torch's device cache


@dataclass
class CaptureClock:
    """Seconds and counts per capture phase: ``eager`` (warm-up passes), ``record <stage>`` (capture and
    instantiation of one stage's graph), ``empty_cache`` (cache flushes before a capture), ``retry`` (captures
    redone after an eager pass, only with ``eager_runs`` 0)."""

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.counts[name] = self.counts.get(name, 0) + 1

    def info(self) -> dict[str, dict[str, float | int]]:
        return {name: {"seconds": round(self.seconds[name], 3), "count": self.counts[name]} for name in self.seconds}


class Recorder:
    """Warm-up passes and graph recording on one capture stream of ``device``, timed by ``clock``.

    eager_runs: eager passes before each capture (PyTorch's examples run a few; one compiles and loads a shape's
    kernels and makes torch's lazy state). 0 (the default) captures first and warms up only a capture that raises
    (then retries once; the clock counts these as ``retry``)."""

    def __init__(self, device: torch.device, *, eager_runs: int = 0, clock: CaptureClock | None = None) -> None:
        if eager_runs < 0:
            raise ValueError(f"eager_runs must be >= 0, got {eager_runs}")
        self.device = device
        self.eager_runs = eager_runs
        self.clock = clock if clock is not None else CaptureClock()
        self._stream: torch.cuda.Stream | None = None

    @property
    def stream(self) -> torch.cuda.Stream:
        """The capture stream (made on first use, so that building a recorder needs no device)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def warm_up(self, fn: Callable[[], object], runs: int | None = None) -> None:
        """Run ``fn`` ``runs`` times (default ``eager_runs``) on the capture stream, ordered after the current one."""
        runs = self.eager_runs if runs is None else runs
        if not runs:
            return
        with self.clock.phase("eager"):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for _ in range(runs):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def make_room(self) -> None:
        """Empty torch's device cache if the device is low on free memory: a capture allocates from its graph
        pool, which cannot use blocks cached for eager work."""
        if torch.cuda.mem_get_info(self.device)[0] < LOW_FREE_BYTES:
            with self.clock.phase("empty_cache"):
                torch.cuda.empty_cache()

    def record(self, fn: Callable[[], T], pool, *, stage: str = "graph") -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture ``fn`` into a graph allocating from ``pool`` -> (graph, fn's output, whose memory the graph owns).
        With ``eager_runs`` 0 a capture that raises is warmed up once and retried (a second failure raises)."""
        try:
            return self._record(fn, pool, stage)
        except Exception:
            if self.eager_runs:
                raise
            with self.clock.phase("retry"):
                self.warm_up(fn, runs=1)
            return self._record(fn, pool, stage)

    def _record(self, fn: Callable[[], T], pool, stage: str) -> tuple[torch.cuda.CUDAGraph, T]:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        with self.clock.phase(f"record {stage}"):
            self.stream.wait_stream(current)
            try:
                with torch.cuda.stream(self.stream):
                    graph.capture_begin(pool=pool)
                    try:
                        out = fn()
                    finally:
                        graph.capture_end()  # raises for an invalidated capture, after ending it
            finally:
                # never leave the caller on the capture stream, whatever failed
                torch.cuda.set_stream(current)
            current.wait_stream(self.stream)
        return graph, out
