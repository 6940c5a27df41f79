"""Probe: chain rows in 64-row programs against AR steps in 32-row ones, for the kernel in the tree (row sums as a
dot with ones) and the kernel of git 2d13ba5 forced to 64 rows (row sums by tl.sum). Counts rows whose bits differ.

    git show 2d13ba5:src/ddtree/models/batch_invariant.py > build/batch_invariant_32only.py
    OUT=... python benchmarks/results/exact_2026-12-01d/probe64.py      # H200: writes $OUT/probe64.json
"""
import importlib.util, json, os, sys
import torch
from ddtree.models import batch_invariant as bi
spec = importlib.util.spec_from_file_location("bi_old", "build/batch_invariant_32only.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def count(mod, set_m):
    kv, g, d = 8, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    one = torch.ones(1, 1, 1, dtype=torch.bool, device="cuda")
    bad = {}
    for T in (16, 9, 12):
        for s in (63, 64, 100, 200, 250, 1000, 1020, 3000):
            kc = torch.randn(2, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            vc = torch.randn(2, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            q = torch.randn(1, kv * g, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            s0 = torch.tensor([s], device="cuda")
            pos = s0[:, None] + torch.arange(T, device="cuda")[None]
            anc, chain = mod.ancestor_map(s0, pos, torch.tril(one.expand(1, T, T)))
            set_m(64)
            o = mod.attention(q, kc, vc, torch.tensor([1], device="cuda"), s0, pos, anc, chain, s + 64)
            set_m(32)
            n = 0
            for t in range(T):
                pt = pos[0, t:t + 1]
                a1, c1 = mod.ancestor_map(pt, pt[:, None], one)
                ar = mod.attention(q[:, :, t:t + 1], kc, vc, torch.tensor([1], device="cuda"), pt, pt[:, None], a1, c1, s + t + 1)
                n += int(not torch.equal(ar[0, :, 0], o[0, :, t]))
            bad[f"T{T}@{s}"] = n
    return bad

res = {}
def set_old(m): old.ATTN_BLOCK_M = m
res["old_tl_sum_64"] = count(old, set_old)
res["new_dot_ones"] = count(bi, lambda m: None)  # the tree's own attention_block_m (64 for T x 4 in 33..64)
orig = bi.attention_block_m
bi.attention_block_m = lambda t, g: bi.ATTN_BLOCK_M
res["new_dot_ones_force32"] = count(bi, lambda m: None)
bi.attention_block_m = orig
for k, v in res.items():
    print(k, "rows off:", sum(v.values()), "of", sum({"T16": 16, "T9": 9, "T12": 12}[c.split("@")[0]] for c in v), flush=True)
json.dump(res, open(os.path.join(os.environ["OUT"], "probe64.json"), "w"), indent=1)
