"""Which kernels a round's forwards spend their time in, on the GPU (eager, torch.profiler): the plain-decoding
step (T = 1), 17- and 129-node verifies, the drafter's block (as the engine runs it: through the tree kernel on
CUDA) and its context append for a 16-token path, on the Qwen3-8B stand-in at a given context.

Why: under CUDA graphs the engine only sees a stage's total; this lists the kernels inside it (count, total and
mean device time), which says what is left to fuse and how far a stage is from its matmuls.

    python benchmarks/profile_step.py --out $OUT/profile.md --context 1024
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.engine import EngineConfig
from ddtree.engine.kernels import KernelSet
from ddtree.lab.bench.kernel_timing import kernel_times, load_standin_pair
from ddtree.speculative.attention import TreeVisibility


def kernel_table(prof, steps: int, cuda: bool, top: int = 18) -> list[str]:
    totals = kernel_times(prof, cuda)  # dry run on a CPU: operators instead of kernels
    grand = sum(v[1] for v in totals.values())
    lines = [f"device time per step: {grand / steps / 1e3:.3f} ms, kernels per step: "
             f"{sum(v[0] for v in totals.values()) / steps:.0f}", "",
             "| kernel | per step | ms per step | share |", "| --- | --- | --- | --- |"]
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| `{name}` | {count / steps:.0f} | {us / steps / 1e3:.3f} | {us / grand:.1%} |")
    return lines


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile.md")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the demo pair itself")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    target, drafter = load_standin_pair(dev)
    kernels = KernelSet.resolve(EngineConfig(gpu_kernels=cuda), target, drafter)  # what an engine would run
    ctx = args.context
    cache = target.allocate_cache(1, ctx + 160)
    dcache = drafter.allocate_cache(1, ctx + 160)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    ids = torch.randint(0, target.config.vocab_size, (1, ctx), device=dev)
    pos = torch.arange(ctx, device=dev)[None]
    vis = torch.ones(ctx, ctx, dtype=torch.bool, device=dev).tril()[None]
    out = target(ids, pos, cache, slots, pos, TreeVisibility(slots, vis, ctx), kernels=kernels,
                 logits_at=torch.tensor([[ctx - 1]], device=dev), hidden_layers=tuple(drafter.config.target_layer_ids))
    drafter.append_context(out.hidden, pos, dcache, slots, pos, kernels=kernels)

    new_ids = torch.randint(0, target.config.vocab_size, (1, 129), device=dev)

    def verify(t: int):
        x = new_ids[:, :t]
        p = ctx + torch.arange(t, device=dev)[None]
        v = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None]
        return lambda: target(x, p, cache, slots, p, TreeVisibility(torch.tensor([ctx], device=dev), v, ctx + t),
                              kernels=kernels)

    def draft():
        start = torch.tensor([ctx], device=dev)
        return drafter.draft_logits(target, ids[:, 0], start, dcache, slots, 16, block_len=torch.tensor([16], device=dev),
                                    window=torch.tensor([1 << 30], device=dev), kv_len=ctx,
                                    kernels=kernels)

    path_hidden = out.hidden[:, -16:].contiguous()  # a round's accepted path: 16 tokens of target features
    path_pos = ctx + torch.arange(16, device=dev)[None]

    def append():
        drafter.append_context(path_hidden, path_pos, dcache, slots, path_pos, kernels=kernels)

    sections = []
    for name, fn in (("AR step (T = 1)", verify(1)), ("verify, 17 nodes", verify(17)), ("verify, 129 nodes", verify(129)),
                     ("drafter block (16)", draft), ("drafter context append (16 tokens)", append)):
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                fn()
            if cuda:
                torch.cuda.synchronize()
        sections += [f"## {name}, context {ctx}", ""] + kernel_table(prof, args.steps, cuda) + [""]
        print("\n".join(sections[-25:]), flush=True)
    with open(args.out, "w") as fh:
        fh.write("# Kernels per forward (eager, H200, stand-in qwen3-8b)\n\n" + "\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
