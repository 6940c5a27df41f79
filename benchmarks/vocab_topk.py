"""Time the vocabulary pass of tree building on a GPU: the Triton top-k + logsumexp kernel (each first-stage
strategy of ``ddtree.speculative.vocab_topk``) against the torch path ``depth_candidates`` falls back to (topk, two
re-ranking sorts, logsumexp). Median ms of CUDA graph replays; bf16 logits, V = 151936 (Qwen) by default.

    python benchmarks/vocab_topk.py            # every strategy with its defaults, the standard shapes
    python benchmarks/vocab_topk.py --sweep    # strategy "running" over chunk x splits (x warps) at 15 and 960 rows

"same" checks every timed kernel against the torch path: same token ids in the same order, equal values, lse
within 2e-6. A sweep row also names the splits the default rule picks for that chunk (the "auto" column).
"""

from __future__ import annotations

import argparse
import math

import torch

from ddtree import tuning
from ddtree.engine.cuda_graphs import warm_up
from ddtree.speculative import vocab_topk

SHAPES = ((15, 8), (15, 16), (15, 64), (15, 512), (960, 8), (960, 16), (960, 64))


def torch_path(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top, tok = torch.topk(x, k, dim=-1, sorted=True)
    tok, by_id = torch.sort(tok, dim=-1)
    top = torch.gather(top.float(), -1, by_id)
    top, by_value = torch.sort(top, dim=-1, descending=True, stable=True)
    return top, torch.gather(tok, -1, by_value), torch.logsumexp(x.float(), dim=-1)


def graphed_ms(fn, repeats: int) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph."""
    warm_up(fn)
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


def same(result, reference) -> bool:
    values, ids, lse = result
    ref_values, ref_ids, ref_lse = reference
    return (torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
            and torch.allclose(lse, ref_lse, rtol=2e-6, atol=2e-6))


def timed(x: torch.Tensor, k: int, reference, repeats: int, **knobs) -> tuple[float, bool]:
    """(median ms, same result as the torch path) of topk_logsumexp(x, k, **knobs)."""
    ok = same(vocab_topk.topk_logsumexp(x, k, **knobs), reference)
    return graphed_ms(lambda: vocab_topk.topk_logsumexp(x, k, **knobs), repeats), ok


def strategies_table(args: argparse.Namespace) -> None:
    print("| rows | k | torch | running | extract | sort | same result |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for rows, k in args.shapes:
        x = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        reference = torch_path(x, k)
        t_torch = graphed_ms(lambda x=x, k=k: torch_path(x, k), args.repeats)
        cells, all_same = [], True
        for strategy in ("running", "extract", "sort"):
            if strategy == "extract" and k > 64:  # K_PAD unrolled maximums per chunk: pointless (and slow) there
                cells.append(math.nan)
                continue
            ms, ok = timed(x, k, reference, args.repeats, strategy=strategy)
            cells.append(ms)
            all_same &= ok
        print(f"| {rows} | {k} | {t_torch:.3f} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {all_same} |",
              flush=True)


def sweep_table(args: argparse.Namespace) -> None:
    """Strategy "running": every chunk x splits (x warps) at each shape; 'auto' = the default splits rule."""
    print("| rows | k | chunk | warps | splits | ms | same | auto splits |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, k in args.shapes:
        x = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        reference = torch_path(x, k)
        for chunk in args.chunks:
            for warps in args.warps or [None]:
                w = warps or min(8, max(1, chunk // tuning.RUNNING_ENTRIES_PER_WARP))
                pieces = -(-args.vocab // chunk)
                auto = vocab_topk.default_splits(rows, pieces, w, sm_count)
                for splits in args.splits:
                    if splits is not None and splits > pieces:
                        continue
                    ms, ok = timed(x, k, reference, args.repeats, strategy="running", chunk=chunk, splits=splits,
                                   warps=warps)
                    shown = "auto" if splits is None else splits
                    print(f"| {rows} | {k} | {chunk} | {w} | {shown} | {ms:.3f} | {ok} | {auto} |", flush=True)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--shapes", type=lambda s: [tuple(_ints(p.replace("x", ","))) for p in s.split(";")],
                    help="rows x k pairs, e.g. '15x16;960x16' (default: the standard seven; --sweep: 15x16;960x16)")
    ap.add_argument("--sweep", action="store_true", help="time strategy 'running' over --chunks x --splits")
    ap.add_argument("--chunks", type=_ints, default=[256, 512, 1024, 2048])
    ap.add_argument("--splits", type=lambda s: [None if v == "auto" else int(v) for v in s.split(",")],
                    default=[None, 1, 2, 3, 4, 8, 16, 32, 64], help="comma list; 'auto' = the default rule")
    ap.add_argument("--warps", type=_ints, default=None, help="comma list of num_warps (default: the module's rule)")
    args = ap.parse_args()
    if args.shapes is None:
        args.shapes = [(15, 16), (960, 16)] if args.sweep else list(SHAPES)
    print(f"{torch.cuda.get_device_name()}, V = {args.vocab}, bf16, median of {args.repeats} graph replays (ms)\n")
    (sweep_table if args.sweep else strategies_table)(args)


if __name__ == "__main__":
    main()
