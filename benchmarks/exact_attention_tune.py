"""Exact mode's attention against the default tree-attention kernel on the shapes of speculative rounds.

Qwen3-8B's heads (32 query heads, 8 KV heads, head dim 128), bf16, random K/V, over a 1k or 4k context: AR at 1 and
64 rows, the DFlash chain (16 tokens), DDTree trees of 17 and 64 nodes at one row and of 9 nodes at 64 rows (random
trees of depth <= 15, each node's parent drawn among the shallower ones). For each shape: microseconds per call of
CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median) of

- ``default``: ``ddtree.models.tree_attention.tree_attention`` (the default engine's kernel);
- ``exact``: ``batch_invariant.attention`` as it is in this tree;
- ``exact_ref`` (with ``--ref FILE``): the same function from another copy of ``batch_invariant.py``, for a
  before/after of a kernel change; then also whether its output has the same bits as ``exact``.

And the property exact mode rests on, on the GPU: every tree node's output equal to the AR step at its position (one
query over the same keys in position order), checked for the 64-node tree.

    python benchmarks/exact_attention_tune.py --out $OUT [--ref build/batch_invariant_before.py]     # H200
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from ddtree.models import batch_invariant as bi
from ddtree.models.tree_attention import tree_attention

HEADS, KV, D = 32, 8, 128
SHAPES = (  # (name, rows, tokens, tree?, context)
    ("AR C=1", 1, 1, False, 1024), ("chain C=1", 1, 16, False, 1024), ("tree 17 C=1", 1, 17, True, 1024),
    ("tree 64 C=1", 1, 64, True, 1024), ("AR C=64", 64, 1, False, 1024), ("tree 9 C=64", 64, 9, True, 1024),
    ("chain C=64", 64, 16, False, 1024), ("AR C=1 4k", 1, 1, False, 4096), ("tree 64 C=1 4k", 1, 64, True, 4096),
)


def random_trees(rows: int, t: int, tree: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [R, T], visibility [R, T, T] with the diagonal): chains, or random trees of depth <= 15."""
    if not tree:
        depth = torch.arange(t).expand(rows, t).clone()
        return depth, torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(rows, t, t).clone()
    depth = torch.zeros(rows, t, dtype=torch.long)
    vis = torch.zeros(rows, t, t, dtype=torch.bool)
    for r in range(rows):
        vis[r, 0, 0] = True
        for i in range(1, t):
            ok = [j for j in range(i) if depth[r, j] < 15]
            p = ok[int(torch.randint(len(ok), (1,), generator=gen))]
            depth[r, i] = depth[r, p] + 1
            vis[r, i] = vis[r, p]
            vis[r, i, i] = True
    return depth, vis


def load_ref(path: str):
    spec = importlib.util.spec_from_file_location("batch_invariant_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_shape(name: str, rows: int, t: int, tree: bool, ctx: int, ref, gen: torch.Generator) -> dict:
    """Time every kernel on one shape (and, for the 64-node tree, check each node against its AR step)."""
    from triton.testing import do_bench_cudagraph

    dev = torch.device("cuda")
    kv_len = ctx + t
    k = torch.randn((rows + 1, KV, kv_len + 64, D), generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(k.shape, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn((rows, t, HEADS, D), generator=gen).to(dev, torch.bfloat16).transpose(1, 2)
    slots = torch.arange(rows, device=dev)
    start = torch.full((rows,), ctx, dtype=torch.long, device=dev)
    depth, vis = random_trees(rows, t, tree, gen)
    depth, vis = depth.to(dev), vis.to(dev)
    positions = start[:, None] + depth
    anc, chain = bi.ancestor_map(start, positions, vis)
    calls = {"default": lambda: tree_attention(q, k, v, slots, start, vis, kv_len),
             "exact": lambda: bi.attention(q, k, v, slots, start, positions, anc, chain, kv_len)}
    if ref is not None:
        calls["exact_ref"] = lambda: ref.attention(q, k, v, slots, start, positions, anc, chain, kv_len)
    row = {"shape": name, "rows": rows, "tokens": t, "context": ctx}
    outs = {}
    for label, fn in calls.items():
        outs[label] = fn().clone()
        row[f"{label}_us"] = round(do_bench_cudagraph(fn, rep=100) * 1e3, 1)
    if ref is not None:
        row["ref_same_bits"] = bool(torch.equal(outs["exact"], outs["exact_ref"]))
    if tree and t == 64:  # each node against the AR step at its position over the same keys
        same = 0
        for node in range(t):
            d = int(depth[0, node])
            order = [j for j in range(t) if vis[0, node, j]]
            order.sort(key=lambda j: int(depth[0, j]))
            k1 = k[:1].clone()
            v1 = v[:1].clone()
            k1[0, :, ctx:ctx + d + 1] = k[0, :, [ctx + j for j in order]]
            v1[0, :, ctx:ctx + d + 1] = v[0, :, [ctx + j for j in order]]
            p1 = torch.full((1, 1), ctx + d, dtype=torch.long, device=dev)
            s1 = torch.full((1,), ctx + d, dtype=torch.long, device=dev)
            one = torch.ones((1, 1, 1), dtype=torch.bool, device=dev)
            a1, c1 = bi.ancestor_map(s1, p1, one)
            ar = bi.attention(q[:1, :, node:node + 1].contiguous(), k1, v1, slots[:1], s1, p1, a1, c1,
                              ctx + d + 1)
            same += bool(torch.equal(ar[0, :, 0], outs["exact"][0, :, node]))
        row["nodes_equal_to_ar"] = f"{same}/{t}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", default=None, help="another batch_invariant.py to time beside this tree's")
    args = ap.parse_args()
    ref = load_ref(args.ref) if args.ref else None
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in SHAPES:
        row = one_shape(*shape, ref, gen)
        rows_out.append(row)
        print(" | ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact_attention_tune.json").write_text(json.dumps({"rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
