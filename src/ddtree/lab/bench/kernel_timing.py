"""Shared by the kernel scripts under ``benchmarks/`` (tree_attention, fp8_gemm, verify_rows, profile_step,
profile_rounds): the device time of a call from a CUDA graph, kernel totals from a torch.profiler run, and the
model pair they time.

Why a module of the package: the scripts used to import each other through ``sys.path``; what two of them share
lives here instead, so each script imports only ``ddtree``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch


def time_ms(fns: Callable[[], object] | list[Callable[[], object]], reps: int = 20) -> float:
    """Device time of one call in ms, from a CUDA graph of ``reps`` calls, call i running ``fns[i % len(fns)]``
    (e.g. one per K/V copy, so a timed call reads its keys from HBM rather than from the L2 the previous call left
    them in). Graph-timed because eager timing would measure Python launch overhead (~0.1 ms a call), not the
    kernels. CUDA only."""
    from ddtree.engine.cuda_graphs import warm_up

    fns = fns if isinstance(fns, list) else [fns]
    reps = max(reps, len(fns))
    for fn in fns:
        warm_up(fn)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (3 * reps)


def kernel_times(prof, cuda: bool, width: int = 90) -> dict[str, list[float]]:
    """Kernel name (its first ``width`` characters) -> [launches, device microseconds] over a torch.profiler run
    ``prof``; on a CPU (a dry run) aten operators and their self time instead."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[evt.name[:width]]
            entry[0] += 1
            entry[1] += evt.device_time_total
        elif not cuda and evt.device_type == torch.autograd.DeviceType.CPU and evt.name.startswith("aten::"):
            entry = totals[evt.name[:width]]
            entry[0] += 1
            entry[1] += evt.self_cpu_time_total
    return dict(totals)


def load_standin_pair(dev: torch.device):
    """(target, drafter) with fused projections: on CUDA the Qwen3-8B stand-in built from the demo pair (bf16),
    on a CPU the demo pair itself (fp32, a dry run of a script)."""
    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models import fuse_projections, load_drafter, load_target
    from ddtree.models.standin import build_standin, standin_shape

    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    target = load_target(demo_target_path(), dtype=dtype, device=dev)
    drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=dev)
    if cuda:
        target, drafter = build_standin(target, drafter, standin_shape("qwen3-8b"))
    fuse_projections(target)  # the layout the engine runs; each forward picks its kernels (KernelSet)
    fuse_projections(drafter)
    return target, drafter
