"""Why greedy speculative outputs can differ from AR's in bf16 on the GPU: isolates the cause (issue 9).

Speculative decoding is lossless when the verify forward computes the same logits as a plain decode step. In
exact arithmetic it does; in bf16 the verify runs the same weights on a different batch shape (16 or 129 tokens
instead of 1), so GEMM tilings, split-K reductions and attention splits differ and the same position's logits can
differ in the last bits. Where the top two logits are that close, the argmax flips and the continuations part.

This script removes every other candidate (the tree, the walk, the compaction, the drafter) and measures the
numerics alone, on the stand-in target and the held-out prompts of ``benchmarks/gpu.py``:

1. AR reference: prefill the prompt, then ``--tokens`` greedy steps of ONE token each (T = 1), through the same
   model code the engine runs (tree-attention kernel, fused layers).
2. Verify-shaped recomputation: another cache slot, the same prefill, then the AR token sequence fed in blocks of
   ``--block`` tokens, either as a chain (root + the next tokens, causal: a DFlash verify whose every node is
   accepted) or as a tree (``--siblings`` random rejected siblings before every path node, so the path sits at
   scattered cache indices as in a DDTree round, then the path's K/V compacted as the engine does). Every
   position's logits then come from a verify-shaped forward over KV that verify-shaped forwards wrote.
3. Compare the argmax at every generated position and the logits themselves; report flips with the T = 1 top-2
   gap at each flip and the typical logit difference. The same in float32 (the stand-in rebuilt in fp32).

If the cause is batch-shape numerics, bf16 shows flips only at near-ties (gap comparable to the logit noise) and
fp32 shows none. Writes ``OUT/divergence.json`` and ``OUT/divergence.md``.

    python benchmarks/divergence.py --out $OUT --prompts 8 --tokens 128
    python benchmarks/divergence.py --out /tmp/d --shape none --device cpu --prompts 2 --tokens 24   # dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddtree.engine import EngineConfig
from ddtree.engine.kernels import KernelSet
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for  # gpu.py's prompts
from ddtree.speculative.attention import TreeVisibility


def _forward(target, cache, ids: list[int], start: int, slot: int) -> torch.Tensor:
    """Causal forward of ``ids`` written at ``start ..``; returns float32 logits [T, V]."""
    t = len(ids)
    vis = torch.ones(t, t, dtype=torch.bool, device=target.device).tril()
    return _tree_forward(target, cache, ids, list(range(t)), vis, start, slot)


def _tree_forward(target, cache, tokens: list[int], depths: list[int], vis: torch.Tensor, start: int,
                  slot: int) -> torch.Tensor:
    """Forward of tree nodes written at ``start + i`` with RoPE position ``start + depth``; logits [N, V]."""
    dev = target.device
    n = len(tokens)
    x = torch.tensor([tokens], device=dev)
    pos = start + torch.tensor([depths], device=dev)
    write = start + torch.arange(n, device=dev)[None]
    tree = TreeVisibility(torch.tensor([start], device=dev), vis[None], start + n)
    kernels = KernelSet.resolve(EngineConfig(gpu_kernels=dev.type == "cuda"), target, None)  # the engine's choice
    out = target(x, pos, cache, torch.tensor([slot], device=dev), write, tree, kernels=kernels)
    return out.logits[0].float()


def tree_layout(path: list[int], siblings: int, vocab: int, seed: int) -> tuple[list[int], list[int], list[int],
                                                                                torch.Tensor]:
    """A verify tree around a known path: before each path node, ``siblings`` random tokens at the same depth with
    the same parent (rejected branches), so the path's nodes sit at scattered cache indices as in a DDTree round.
    Returns (tokens, depths, path node indices, ancestor visibility [N, N])."""
    gen = torch.Generator().manual_seed(seed)
    tokens, depths, parents, on_path = [path[0]], [0], [-1], [0]
    for d in range(1, len(path)):
        for tok in torch.randint(0, vocab, (siblings,), generator=gen).tolist():
            tokens.append(tok)
            depths.append(d)
            parents.append(on_path[-1])
        tokens.append(path[d])
        depths.append(d)
        parents.append(on_path[-1])
        on_path.append(len(tokens) - 1)
    n = len(tokens)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return tokens, depths, on_path, vis


@torch.inference_mode()
def compare(target, prompts: list[list[int]], tokens: int, block: int, siblings: int) -> dict:
    """Per prompt: AR logits (T = 1) against chain-shaped and tree-shaped verify logits at every position."""
    from ddtree.speculative import compact_cache

    dev = target.device
    max_len = max(len(p) for p in prompts) + tokens + block * (siblings + 1) + 2
    cache = target.allocate_cache(3, max_len)
    stats = {mode: {"flips": [], "gaps": [], "diffs": []} for mode in ("chain", "tree")}
    compared, ties = 0, 0
    for pi, prompt in enumerate(prompts):
        # AR: prefill prompt[:-1], then one token per step from the prompt's last token
        _forward(target, cache, prompt[:-1], 0, 0)
        seq = list(prompt)
        ar_logits = []
        for _ in range(tokens):
            logits = _forward(target, cache, [seq[-1]], len(seq) - 1, 0)[0]
            ar_logits.append(logits)
            seq.append(int(logits.argmax()))
        # chain-shaped verify (slot 1) and tree-shaped verify + compaction (slot 2) over the AR sequence
        verify = {"chain": [], "tree": []}
        for mode, slot in (("chain", 1), ("tree", 2)):
            _forward(target, cache, prompt[:-1], 0, slot)
            at = len(prompt) - 1
            while len(verify[mode]) < tokens:
                chunk = seq[at : at + block]
                if mode == "chain":
                    verify[mode].extend(_forward(target, cache, chunk, at, slot).unbind(0))
                else:
                    ids, depths, on_path, vis = tree_layout(chunk, siblings, target.config.vocab_size, pi * 7919 + at)
                    logits = _tree_forward(target, cache, ids, depths, vis.to(dev), at, slot)
                    verify[mode].extend(logits[on_path].unbind(0))
                    path = torch.tensor([on_path], device=dev)
                    for c in (cache.k, cache.v):  # the accepted path's K/V to at .. at + len(chunk) - 1
                        compact_cache(c, torch.tensor([slot], device=dev), torch.tensor([at], device=dev), path)
                at += len(chunk)
        for i in range(tokens):
            a = ar_logits[i]
            compared += 1
            top2 = a.topk(2).values
            ties += int(top2[0] == top2[1])  # bf16 logits are coarse (1/16 near 16): exact top-2 ties happen
            for mode in ("chain", "tree"):
                v = verify[mode][i]
                st = stats[mode]
                st["diffs"].append(float((a - v).abs().max()))
                if int(a.argmax()) != int(v.argmax()):
                    st["flips"].append({"prompt": pi, "position": i})
                    st["gaps"].append(float(top2[0] - top2[1]))
    out = {"positions": compared, "exact_top2_ties_t1": ties}
    for mode, st in stats.items():
        out[mode] = {
            "argmax_flips": len(st["flips"]),
            "flips": st["flips"][:20],
            "top2_gap_at_flips": [round(g, 5) for g in st["gaps"][:20]],
            "logit_diff_nonzero_share": sum(d > 0 for d in st["diffs"]) / max(len(st["diffs"]), 1),
            "max_abs_logit_diff_median": statistics.median(st["diffs"]) if st["diffs"] else None,
            "max_abs_logit_diff_max": max(st["diffs"]) if st["diffs"] else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="divergence_out")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--siblings", type=int, default=3, help="rejected siblings before each path node (tree mode)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--fp32-prompts", type=int, default=2, help="float32 is slow: fewer prompts")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    from ddtree.assets import demo_drafter_path, demo_target_path
    from ddtree.models import fuse_projections, load_drafter, load_target, load_tokenizer

    tokenizer = load_tokenizer(demo_target_path())
    prompts = prompts_for(held_out_token_stream(tokenizer, args.context * 2 + 4096), args.context, args.prompts, 7)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": args.shape, "context": args.context, "tokens": args.tokens,
              "block": args.block, "siblings": args.siblings, "results": {}}
    lines = [f"Device {report['device']}, torch {report['torch']}, shape {args.shape}, {args.tokens} greedy tokens "
             f"per prompt at context {args.context}; verify blocks of {args.block}; tree mode: {args.siblings} "
             "rejected siblings before each path node, then compaction.", "",
             "| dtype | prompts | positions | exact top-2 ties (T=1) | mode | argmax flips | top-2 gap at the flips "
             "| positions with any logit difference | max abs logit diff: median / max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        t0 = time.perf_counter()
        target = load_target(demo_target_path(), dtype=dtype, device=device)
        if args.shape != "none":
            from ddtree.models.standin import build_standin, standin_shape

            drafter = load_drafter(demo_drafter_path(), dtype=dtype, device=device)
            target, drafter = build_standin(target, drafter, standin_shape(args.shape))
            del drafter
        if device.type == "cuda":
            fuse_projections(target)  # the layers the engine runs
        use = prompts if dtype != torch.float32 else prompts[: args.fp32_prompts]
        res = compare(target, use, args.tokens, args.block, args.siblings)
        res["prompts"] = len(use)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["results"][name] = res
        (out / "divergence.json").write_text(json.dumps(report, indent=1))
        for mode in ("chain", "tree"):
            r = res[mode]
            lines.append(f"| {name} | {len(use)} | {res['positions']} | {res['exact_top2_ties_t1']} | {mode} | "
                         f"{r['argmax_flips']} | {r['top2_gap_at_flips']} | {r['logit_diff_nonzero_share']:.1%} | "
                         f"{r['max_abs_logit_diff_median']:.4g} / {r['max_abs_logit_diff_max']:.4g} |")
        (out / "divergence.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[-2:]), flush=True)
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
