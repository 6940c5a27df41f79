"""Recording CUDA graphs at start-up speed: no per-capture cache flush, eager passes only for what is new, a clock.

Why not ``torch.cuda.graph`` as is: each use synchronises the device, empties torch's device cache and its pinned
host cache, then captures. A round key is several stage graphs, so a warm-up of a thousand keys paid that several
times a key, and every flush handed the eager passes' transient blocks back to the driver, to be allocated again by
the next key's eager pass (``cudaFree`` synchronises too). Here a capture is ``capture_begin`` / ``capture_end`` on
one capture stream, and the device cache is emptied only when free memory runs low (:meth:`Recorder.make_room`).

Eager passes: PyTorch asks for one before a capture because first uses must not happen inside it (cuBLAS creates
its handle and workspace for a thread and stream, cuBLASLt its own, Triton compiles and loads a variant); a first
use inside a capture invalidates it (``CUBLAS_STATUS_NOT_INITIALIZED`` from ``cublasCreate``, H200, 2026-12-01)
and leaves torch's allocator recording into the graph's pool, so every later capture into that pool fails. A pass
costs as much host time as the recording (about 30 ms for the stand-in's 36-layer forward), so the recorder runs
one per *signature*: the caller names a class of stages whose kernels are likely the same (the draft's and the
layers' row and node counts, not the key length) and a signature met once on a thread is not warmed up again
(re-capturing 40 round keys on the H200: 87 ms a key with two eager passes, 57 with one, 31 with none). A signature
is a guess, not a promise: a stage of a known signature may still meet a first use (a tree-attention variant of
another key length: Triton loads its module with ``cuModuleLoadData``, which the driver refuses while a stream
captures). :meth:`Recorder.record_stages` then warms up and captures again, once; a capture that fails forgets its
signature, so the next key of it warms up first.

:class:`CaptureClock` adds up where the time goes (eager passes, recording per stage, cache flushes) so that
``Engine.info()["warmup"]["capture"]`` and the start-up benchmark can say it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("ddtree.engine")

LOW_FREE_BYTES = 2 << 30  # below this much free device memory a capture first empties torch's device cache


@dataclass
class CaptureClock:
    """Seconds and counts per capture phase: ``eager`` (warm-up passes), ``record <stage>`` (capture and
    instantiation of one stage's graph), ``retry`` (eager passes after a capture of a known signature failed: its
    count is the number of such failures), ``empty_cache`` (cache flushes before a capture)."""

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
    """Eager passes and graph recording on one capture stream of ``device``, timed by ``clock``.

    eager_runs: eager passes before a capture whose signature is new on this thread (0: none; the capture must then
    meet no first use)."""

    def __init__(self, device: torch.device, *, eager_runs: int = 1, clock: CaptureClock | None = None) -> None:
        if eager_runs < 0:
            raise ValueError(f"eager_runs must be >= 0, got {eager_runs}")
        self.device = device
        self.eager_runs = eager_runs
        self.clock = clock if clock is not None else CaptureClock()
        self._stream: torch.cuda.Stream | None = None
        self._seen: set[tuple[int, Hashable]] = set()

    @property
    def stream(self) -> torch.cuda.Stream:
        """The capture stream (made on first use, so that building a recorder needs no device)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def warm_up(self, fn: Callable[[], object], signature: Hashable = None) -> bool:
        """Run ``fn`` ``eager_runs`` times on the capture stream, ordered after the current one, unless
        ``signature`` (None: always new) was warmed up on this thread already -> whether it ran."""
        seen = (threading.get_ident(), signature)
        if not self.eager_runs or (signature is not None and seen in self._seen):
            return False
        with self.clock.phase("eager"):
            self._eager(fn)
        if signature is not None:
            self._seen.add(seen)
        return True

    def _eager(self, fn: Callable[[], object]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.eager_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def record_stages(self, eager: Callable[[], object], stages: Sequence[tuple[str, Callable[[], T]]], pool, *,
                      signature: Hashable) -> list[tuple[torch.cuda.CUDAGraph, T]]:
        """Capture each (stage name, fn) of ``stages`` in order -> their (graph, output), after eager passes of
        ``eager`` (every stage's work, on scratch outputs) if ``signature`` is new on this thread. If it was not
        and a capture fails (a first use the signature did not foresee), ``eager`` runs and that capture is tried
        once more; the retries are counted in :attr:`clock` as ``retry``. A second failure, or one after eager
        passes, is raised."""
        warmed = self.warm_up(eager, signature)
        out = []
        for stage, fn in stages:
            try:
                out.append(self.record(fn, pool, stage=stage, signature=signature))
            except Exception as exc:
                if warmed or not self.eager_runs:
                    raise
                log.warning("capture of %s (signature %s) failed without eager passes (%s: %s); warming up and "
                            "capturing again", stage, signature, type(exc).__name__, exc)
                self._seen.discard((threading.get_ident(), signature))
                with self.clock.phase("retry"):
                    warmed = self.warm_up(eager, signature)
                out.append(self.record(fn, pool, stage=stage, signature=signature))
        return out

    def forget(self) -> None:
        """Forget every signature met (the next capture of each warms up again): for benchmarks of the eager cost."""
        self._seen.clear()

    def make_room(self) -> None:
        """Empty torch's device cache if the device is low on free memory: a capture allocates from its graph
        pool, which cannot use blocks cached for eager work."""
        if torch.cuda.mem_get_info(self.device)[0] < LOW_FREE_BYTES:
            with self.clock.phase("empty_cache"):
                torch.cuda.empty_cache()

    def record(self, fn: Callable[[], T], pool, *, stage: str = "graph",
               signature: Hashable = None) -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture ``fn`` into a graph allocating from ``pool`` -> (graph, fn's output, whose memory the graph owns).
        If it fails, ``signature`` is forgotten (the next capture of it warms up first) and the error raised."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        with self.clock.phase(f"record {stage}"), _no_collection():
            self.stream.wait_stream(current)
            began = ended = False
            try:
                with torch.cuda.stream(self.stream):
                    began = True  # from here on a failure may leave the allocator recording into the pool
                    graph.capture_begin(pool=pool)
                    try:
                        out = fn()
                    finally:
                        graph.capture_end()  # raises for an invalidated capture (fn's error, or a first use)
                        ended = True
            except BaseException:
                self._seen.discard((threading.get_ident(), signature))
                if began and not ended:
                    _stop_pool(self.device, pool)
                raise
            finally:
                torch.cuda.set_stream(current)  # never leave the caller on the capture stream
            current.wait_stream(self.stream)
        return graph, out


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector off while a graph records. Why: a collection that runs inside a capture
    (any allocation of Python objects may start one) and frees an older CUDA graph, an engine's that was shut down
    in the same process, calls the driver's graph destroy, which is not permitted while a stream captures: the
    capture is invalidated ("operation not permitted when stream is capturing" from ``CUDAGraph::reset``, then
    every later capture into the pool fails; the H100 GPU warm-up test of 2026-12-05, its second engine).
    ``torch.cuda.graph`` runs ``gc.collect()`` before each capture instead, which costs milliseconds a capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stop_pool(device: torch.device, pool) -> None:
    """After a capture that ``capture_end`` could not end: it raises before it tells torch's allocator to stop
    allocating into the pool, which would make every later capture into that pool fail ("already recording"), so
    the allocator is told directly (torch's private hook, where it exists; best effort)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except Exception:  # noqa: S110 (nothing better to do: the caller raises the capture's own error)
            pass
