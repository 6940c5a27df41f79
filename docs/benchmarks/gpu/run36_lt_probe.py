"""Ad hoc probe of run 36 (d08a45f), kept as the record of run36_lt_probe.md; not a maintained benchmark.

Host cost of cuBLAS against cuBLASLt on the stand-in: eager forward time, graph capture time, GPU replay time.
Run from the repository root with PYTHONPATH=src on a CUDA machine."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path("benchmarks").resolve()))
from profile_step import load_standin_pair  # noqa: E402

from ddtree.models import TreeVisibility, gemm_backend  # noqa: E402

gemm_backend.enabled = False
dev = torch.device("cuda")
with torch.inference_mode():
    target, drafter = load_standin_pair(dev)
    cache = target.allocate_cache(1, 512)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    for t in (64, 16):
        x = torch.randint(0, 100, (1, t), device=dev)
        p = 60 + torch.arange(t, device=dev)[None]
        vis = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None]
        tree = TreeVisibility(torch.tensor([60], device=dev), vis, 60 + t)

        def f(x=x, p=p, tree=tree):
            return target(x, p, cache, slots, p, None, tree=tree)

        for lib in ("cublas", "cublaslt", "cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                f()
            host = (time.perf_counter() - t0) / 5
            torch.cuda.synchronize()
            eager = (time.perf_counter() - t0) / 5
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            t0 = time.perf_counter()
            with torch.cuda.stream(s):
                f()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            torch.cuda.synchronize()
            cap = time.perf_counter() - t0
            g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            rep = (time.perf_counter() - t0) / 20
            print(f"T={t} {lib:9s} eager host {host * 1e3:7.2f} ms, eager wall {eager * 1e3:7.2f} ms, "
                  f"capture {cap * 1e3:8.1f} ms, replay {rep * 1e3:6.3f} ms", flush=True)
