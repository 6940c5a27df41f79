"""Probe: does a 64-row attention program (chain of 16) give the AR step's bits? Kernel, then engine."""
import json, os, sys, time
import torch
from ddtree.models import batch_invariant as bi
out = os.environ["OUT"]
orig = bi.attention_block_m
res = {}
def kernel(force32):
    bi.attention_block_m = (lambda t, g: bi.ATTN_BLOCK_M) if force32 else orig
    kv, g, d = 8, 4, 128
    bad = {}
    torch.manual_seed(0)
    for T in (16, 9, 8):
        for s in (63, 64, 100, 200, 1000, 3000):
            kc = torch.randn(3, kv, 4096, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(3, kv, 4096, d, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, kv * g, T, d, device="cuda", dtype=torch.bfloat16)
            s0 = torch.tensor([s], device="cuda")
            pos = s0[:, None] + torch.arange(T, device="cuda")[None]
            vis = torch.tril(torch.ones(1, T, T, dtype=torch.bool, device="cuda"))
            anc, chain = bi.ancestor_map(s0, pos, vis)
            o = bi.attention(q, kc, vc, torch.tensor([0], device="cuda"), s0, pos, anc, chain, s + 64)
            one = torch.ones(1, 1, 1, dtype=torch.bool, device="cuda")
            n = 0
            for t in range(T):
                pt = torch.tensor([s + t], device="cuda")
                a1, c1 = bi.ancestor_map(pt, pt[:, None], one)
                ar = bi.attention(q[:, :, t:t + 1], kc, vc, torch.tensor([0], device="cuda"), pt, pt[:, None], a1, c1, s + t + 1)
                n += int(not torch.equal(ar[0, :, 0], o[0, :, t]))
            bad[f"T{T}@{s}"] = n
    bi.attention_block_m = orig
    return bad
res["kernel_block64"] = kernel(False)
res["kernel_force32"] = kernel(True)
print(json.dumps(res), flush=True)
from ddtree.engine import Engine, EngineConfig, TreeSettings
from ddtree.lab.bench.inprocess import run_cell
from ddtree.lab.bench.workload import held_out_token_stream, prompts_for
from ddtree.models import load_tokenizer
from ddtree.models.standin import load_demo_benchmark_pair
target, drafter, tdir = load_demo_benchmark_pair("qwen3-8b", torch.device("cuda"), torch.bfloat16)
tok = load_tokenizer(tdir)
stream = held_out_token_stream(tok, 4096 * 2 + 4096)
prompts = prompts_for(stream, 1024, 64, salt=1024)[:4]
for force32 in (False, True):
    bi.attention_block_m = (lambda t, g: bi.ATTN_BLOCK_M) if force32 else orig
    eng = Engine(target, drafter, tok, EngineConfig(max_batch=4, max_len=1400, max_budget=64, exact=True, warmup="none"))
    eng.start()
    ar = run_cell(eng, prompts, TreeSettings(method="ar"), 256, concurrency=1)["tokens"]
    row = {}
    for name, tree in (("dflash", TreeSettings(method="dflash")), ("b8", TreeSettings(method="ddtree", budget=8))):
        toks = run_cell(eng, prompts, tree, 256, concurrency=1)["tokens"]
        row[name] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), -1) for x, y in zip(ar, toks)]
    res[f"engine_force32={force32}"] = row
    print(json.dumps(row), flush=True)
    eng.shutdown(drain_timeout=0)
json.dump(res, open(f"{out}/probe.json", "w"), indent=1)
