"""Why greedy speculative outputs can differ from AR's in bf16 on the GPU: isolates the cause (issue 9).

Speculative decoding is lossless when the verify forward computes the same logits as a plain decode step. In
exact arithmetic it does; in bf16 the verify runs the same weights on a different batch shape (16 or 129 tokens
instead of 1), so GEMM tilings, split-K reductions and attention splits differ and the same position's logits can
differ in the last bits. Where the top two logits are that close, the argmax flips and the continuations part.

This script removes every other candidate (the tree, the walk, the compaction, the drafter) and measures the
numerics alone, on the stand-in target and the held-out prompts of ``benchmarks/gpu.py``:

1. AR reference: prefill the prompt, then ``--tokens`` greedy steps of ONE token each (T = 1), through the same
   model code the engine runs (tree-attention kernel, fused layers).
2. Verify-shaped recomputation: a second cache slot, the same prefill, then the AR token sequence fed in blocks of
   ``--block`` tokens (root + the next tokens, causal: exactly a DFlash chain verify whose every node is accepted),
   so every position's logits come from a T = block forward over KV that T = block forwards wrote.
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
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import held_out_token_stream, prompts_for  # noqa: E402

from ddtree.models import TreeVisibility  # noqa: E402


def _forward(target, cache, ids: list[int], start: int, slot: int) -> torch.Tensor:
    """Causal forward of ``ids`` written at ``start ..``; returns float32 logits [T, V]."""
    dev = target.device
    t = len(ids)
    x = torch.tensor([ids], device=dev)
    pos = start + torch.arange(t, device=dev)[None]
    vis = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None]
    tree = TreeVisibility(torch.tensor([start], device=dev), vis, start + t)
    out = target(x, pos, cache, torch.tensor([slot], device=dev), pos, None, tree=tree)
    return out.logits[0].float()


@torch.inference_mode()
def compare(target, prompts: list[list[int]], tokens: int, block: int) -> dict:
    max_len = max(len(p) for p in prompts) + tokens + block + 1
    cache = target.allocate_cache(2, max_len)
    flips, gaps_at_flips, diffs, compared, ties = [], [], [], 0, 0
    for pi, prompt in enumerate(prompts):
        # AR: prefill prompt[:-1], then one token per step from the prompt's last token
        _forward(target, cache, prompt[:-1], 0, 0)
        seq = list(prompt)
        ar_logits = []
        for _ in range(tokens):
            logits = _forward(target, cache, [seq[-1]], len(seq) - 1, 0)[0]
            ar_logits.append(logits)
            seq.append(int(logits.argmax()))
        # verify-shaped: same prefill into slot 1, then blocks of `block` tokens of the AR sequence
        _forward(target, cache, prompt[:-1], 0, 1)
        verify_logits = []
        at = len(prompt) - 1
        while len(verify_logits) < tokens:
            chunk = seq[at : at + block]
            verify_logits.extend(_forward(target, cache, chunk, at, 1).unbind(0))
            at += len(chunk)
        for i in range(tokens):
            a, v = ar_logits[i], verify_logits[i]
            compared += 1
            diffs.append(float((a - v).abs().max()))
            top2 = a.topk(2).values
            ties += int(top2[0] == top2[1])  # bf16 logits are coarse (1/16 near 16): exact top-2 ties happen
            if int(a.argmax()) != int(v.argmax()):
                flips.append({"prompt": pi, "position": i})
                gaps_at_flips.append(float(top2[0] - top2[1]))
    return {
        "positions": compared,
        "argmax_flips": len(flips),
        "exact_top2_ties_t1": ties,
        "flips": flips[:20],
        "top2_gap_at_flips": [round(g, 5) for g in gaps_at_flips[:20]],
        "max_abs_logit_diff_median": statistics.median(diffs) if diffs else None,
        "max_abs_logit_diff_max": max(diffs) if diffs else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="divergence_out")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dtypes", default="bfloat16,float32")
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
              "block": args.block, "results": {}}
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
            fuse_projections(target, kernels=True)  # the layers the engine runs
        res = compare(target, prompts, args.tokens, args.block)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["results"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "flips"}), flush=True)
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (out / "divergence.json").write_text(json.dumps(report, indent=1))
    lines = [f"Device {report['device']}, torch {report['torch']}, shape {args.shape}, {args.prompts} prompts x "
             f"{args.tokens} greedy tokens at context {args.context}; verify-shaped blocks of {args.block}.", "",
             "| dtype | positions | argmax flips | exact top-2 ties (T=1) | top-2 gap (T=1 logits) at the flips "
             "| max abs logit diff: median / max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['positions']} | {r['argmax_flips']} | {r['exact_top2_ties_t1']} | {r['top2_gap_at_flips']} | "
                     f"{r['max_abs_logit_diff_median']:.4g} / {r['max_abs_logit_diff_max']:.4g} |")
    (out / "divergence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
