"""Time the vocabulary pass of tree building on a GPU: the Triton top-k + logsumexp kernel (both first-stage
strategies) against the torch path ``depth_candidates`` falls back to (topk, two re-ranking sorts, logsumexp).

    python benchmarks/vocab_topk.py            # CUDA only; prints a markdown table (median ms, CUDA graph replay)
"""

from __future__ import annotations

import argparse

import torch

from ddtree.spec import vocab_topk


def torch_path(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top, tok = torch.topk(x, k, dim=-1, sorted=True)
    tok, by_id = torch.sort(tok, dim=-1)
    top = torch.gather(top.float(), -1, by_id)
    top, by_value = torch.sort(top, dim=-1, descending=True, stable=True)
    return top, torch.gather(tok, -1, by_value), torch.logsumexp(x.float(), dim=-1)


def graphed_ms(fn, repeats: int) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print("| rows | k | torch | triton, repeated max | triton, tl.topk | same result |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for rows, k in ((15, 8), (15, 16), (15, 64), (15, 512), (960, 8), (960, 16), (960, 64)):
        x = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        ref = torch_path(x, k)
        ex = vocab_topk.topk_logsumexp(x, k, extract=True) if k <= 64 else None
        st = vocab_topk.topk_logsumexp(x, k, extract=False)
        same = all(torch.equal(a[1], ref[1]) for a in (ex, st) if a is not None)
        t_torch = graphed_ms(lambda x=x, k=k: torch_path(x, k), args.repeats)
        t_ex = graphed_ms(lambda x=x, k=k: vocab_topk.topk_logsumexp(x, k, extract=True),
                          args.repeats) if ex else float("nan")
        t_st = graphed_ms(lambda x=x, k=k: vocab_topk.topk_logsumexp(x, k, extract=False), args.repeats)
        print(f"| {rows} | {k} | {t_torch:.3f} | {t_ex:.3f} | {t_st:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
