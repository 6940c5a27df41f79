"""Ahead-of-time compilation of the warm-up's tree-attention variants in worker processes.

Why: Triton compiles a kernel variant on its first launch, in the launching thread, and its compiler holds the
GIL for most of the work (two threads compiled four split-kernel variants in 34.5 s against 35.5 s one after the
other on a 2-core machine), so the warm-up's compilations ran one at a time: on the H200 run of 2026-12-01, 93 of
them took 64.4 s of a cold start's 105.7 s. The tree-attention kernels are the largest of them and the only ones
whose variants are known without running the model (:func:`ddtree.models.tree_attention.plan_launch`).

How: for every tree-attention launch the plan will meet, the main process binds the kernels with dummy inputs of
the real shapes, dtypes and caches (``tree_attention(..., compile_only=True)``), through Triton's own binder, while
``triton.knobs.runtime.jit_cache_hook`` records each variant's specialisation (Triton's ``specialization_data``, the
form ``JITFunction.preload`` reads) and skips its compilation. Worker processes (spawned: they never touch CUDA)
rebuild each variant as ``JITFunction.preload`` does and compile it with ``triton.compile`` for the device's
target, which stores it in Triton's on-disk cache under the same key; the warm-up's captures then load it from
disk (a few ms). Anything that fails (no Triton, a worker dying, a key that does not match) only leaves that
variant to compile in the main process, as without this module.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("ddtree.engine")

Spec = tuple[str, str, str]  # (module, kernel name, Triton's specialization_data JSON)


@dataclass(frozen=True)
class AttentionCall:
    """One tree-attention launch to precompile: R rows of T new tokens over ``kv_len`` keys of ``cache`` (one
    layer's K cache, for its shape, dtype and strides), queries of ``heads`` heads, with or without a window."""

    rows: int
    tokens: int
    kv_len: int
    heads: int
    has_first: bool
    cache: str  # "target" or "draft"


def collect(calls: Iterable[AttentionCall], caches: dict, dtype) -> list[Spec]:
    """The variants ``calls`` need that this process has not compiled yet, without compiling or launching any
    (CUDA only: Triton's binder reads the device). ``caches``: "target" / "draft" -> a K cache layer."""
    import torch
    from triton import knobs

    from ddtree.models.tree_attention import tree_attention

    found: dict[str, Spec] = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        found.setdefault(str(key), (str(fn.module), str(fn.name), compile["specialization_data"]))
        return True  # skip the compilation (and the launch: this is a warm-up call)

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for call in calls:
            cache = caches[call.cache]
            dev = cache.device
            r, t, d = call.rows, call.tokens, cache.shape[-1]
            q = torch.empty((r, t, call.heads, d), dtype=dtype, device=dev).transpose(1, 2)  # the layers' layout
            zeros = torch.zeros(r, dtype=torch.long, device=dev)
            tree_attention(q, cache, cache, zeros, zeros, torch.ones((r, t, t), dtype=torch.bool, device=dev),
                           call.kv_len, first=zeros if call.has_first else None, compile_only=True)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(found.values())


def _source(module: str, name: str, data: str, target):
    """``JITFunction.preload``'s reading of Triton's specialisation ``data`` (Triton 3.6) -> (ASTSource, options
    dict) for ``target``: what ``triton.compile`` takes, and what its cache key is made of."""
    import importlib
    import json

    import triton.language as tl
    from triton.compiler import ASTSource, make_backend

    fn = getattr(importlib.import_module(module), name)
    obj = json.loads(data)
    constexprs = {}
    for key, value in zip(obj["constant_keys"], obj["constant_vals"], strict=True):
        if tl.dtype.is_dtype(value):
            value = tl.dtype(value)
        elif isinstance(value, dict) and "constexpr" in value:
            value = tl.constexpr(value["constexpr"])
        constexprs[tuple(key)] = value
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"], strict=True))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    options = make_backend(target).parse_options(options)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def compile_spec(module: str, name: str, data: str, target) -> float:
    """Compile one variant into Triton's on-disk cache (a worker's job): ``triton.compile`` for ``target`` instead
    of the current device. Returns seconds."""
    import triton

    t0 = time.perf_counter()
    src, options = _source(module, name, data, target)
    triton.compile(src, target=target, options=options)
    return time.perf_counter() - t0


def on_disk(module: str, name: str, data: str, target) -> bool:
    """Whether Triton's on-disk cache holds the variant already (the lookup ``triton.compile`` starts with: its
    cache key, then the kernel's metadata file in that key's group), so that a warm cache spawns no workers (on the
    H200 the 15 workers took 6.8 s to find all 43 variants on disk)."""
    import hashlib

    from triton import knobs
    from triton.compiler import get_cache_key, make_backend
    from triton.runtime.cache import get_cache_manager

    if knobs.compilation.always_compile:
        return False
    src, options = _source(module, name, data, target)
    backend = make_backend(target)
    key = get_cache_key(src, backend, backend.parse_options(options), env_vars=_env_vars())
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(f"{src.name[:150]}.json")
    return bool(group) and f"{src.name[:150]}.json" in group


def _env_vars() -> dict:
    from triton.compiler.compiler import get_cache_invalidating_env_vars

    return get_cache_invalidating_env_vars()


@dataclass
class Precompiled:
    """What a precompilation did: variants found, already on disk, compiled by the workers, failed; wall seconds;
    workers."""

    variants: int = 0
    on_disk: int = 0
    compiled: int = 0
    failed: int = 0
    seconds: float = 0.0
    workers: int = 0

    def info(self) -> dict:
        return {"variants": self.variants, "on_disk": self.on_disk, "compiled": self.compiled, "failed": self.failed,
                "seconds": round(self.seconds, 3), "workers": self.workers}


def precompile(collect_specs: Callable[[], list[Spec]], *, workers: int | None = None) -> Precompiled:
    """Collect the specs, compile those not on disk yet in ``workers`` spawned processes (default: the CPUs this
    process may run on, less one, at most 16) and wait for them. Never raises: a failure is logged and leaves the
    variants to the main process."""
    out = Precompiled()
    t0 = time.perf_counter()
    try:
        from triton.runtime import driver

        specs = collect_specs()
        out.variants = len(specs)
        target = driver.active.get_current_target()
        missing = []
        for spec in specs:
            try:
                found = on_disk(*spec, target)
            except Exception:  # a lookup that fails only means the worker looks again
                found = False
            if not found:
                missing.append(spec)
        out.on_disk = len(specs) - len(missing)
        specs = missing
        if not specs:
            out.seconds = time.perf_counter() - t0
            return out
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        out.workers = min(len(specs), workers or max(1, min(16, cpus - 1)))
        with ProcessPoolExecutor(out.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(compile_spec, *spec, target) for spec in specs]
            for future, spec in zip(futures, specs, strict=True):
                try:
                    future.result()
                    out.compiled += 1
                except Exception as exc:  # one variant failing only leaves it to the main process
                    out.failed += 1
                    log.warning("precompile of %s failed (%s: %s)", spec[1], type(exc).__name__, exc)
    except Exception as exc:
        log.warning("tree-attention precompilation skipped (%s: %s)", type(exc).__name__, exc)
    out.seconds = time.perf_counter() - t0
    log.info("precompiled %d of %d tree-attention variants in %d processes (%d on disk already), %.1f s",
             out.compiled, out.variants, out.workers, out.on_disk, out.seconds)
    return out


def planned_calls(plan, dims, cache_len: int) -> list[AttentionCall]:
    """Every tree-attention launch of a :class:`~ddtree.engine.warmup.WarmupPlan` (``dims``: its
    :class:`~ddtree.engine.cuda_graphs.AttentionDims`): each round key's verify and drafter block (as
    :func:`~ddtree.engine.cuda_graphs.round_launches` counts them), each graphed prefill key (over its width) and
    each eager chunk; distinct calls only."""
    heads = dims.target[0]
    calls: dict[AttentionCall, None] = {}
    for key in plan.rounds:
        calls[AttentionCall(key.rows, key.max_budget + 1, key.kv_len, heads, False, "target")] = None
        if key.drafts and dims.draft is not None:
            calls[AttentionCall(key.rows, key.block_size, min(key.draft_kv_len + key.block_size, cache_len),
                                dims.draft[0], True, "draft")] = None
    for key in plan.prefills:
        calls[AttentionCall(key.rows, key.width, key.width, heads, False, "target")] = None
    for chunk in plan.eager_chunks:
        calls[AttentionCall(chunk.rows, chunk.width, chunk.kv_len, heads, False, "target")] = None
    return list(calls)
