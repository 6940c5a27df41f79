"""Exact mode's attention against the default tree-attention kernel on the shapes of speculative rounds.

Qwen3-8B's heads (32 query heads, 8 KV heads, head dim 128), bf16, random K/V, over a 1k or 4k context: AR at 1 and
64 rows, the DFlash chain (16 tokens), DDTree trees of 17 and 64 nodes at one row, of 9 nodes at 8 rows and of 9 and
16 nodes at 64 rows (random trees of depth <= 15, each node's parent drawn among the shallower ones), and DDTree's
own best-first trees of 9 and 16 nodes at 64 rows and of 64 at 8 (``served_trees``, not yet run on a GPU). For each shape:
microseconds per call of CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median) of

- ``default``: ``ddtree.models.tree_attention.tree_attention`` (the default engine's kernel);
- ``exact``: ``batch_invariant.attention_launch.attention`` as it is in this tree (its launch by ``attention_fused``);
- ``exact_split`` / ``exact_fused``: the same with each launch forced (``fused=False`` / ``True``), and
  ``exact_fused_s3`` the fused launch in three pipeline stages; ``fused_same_bits``: whether all three give the same
  output;
- ``exact_ref`` (with ``--ref FILE``): the same function from another copy, for a before/after of a kernel change;
  then also whether its output has the same bits as ``exact``. FILE is one module holding ``attention`` and
  ``ATTN_SPLIT_KEYS``: the single-file ``batch_invariant.py`` of a commit before the package
  (``git show C:src/ddtree/models/batch_invariant.py > build/batch_invariant_before.py``). Two versions of the
  package itself compare by running this script in each checkout.

And the property exact mode rests on, on the GPU: every tree node's output equal to the AR step at its position (one
query over the same keys in position order), checked for each tree shape's first row.

    python benchmarks/exact_attention_tune.py --out $OUT [--ref build/batch_invariant_before.py]     # H200
    python benchmarks/exact_attention_tune.py --out $OUT --bucket    # at the engine's key-length buckets
    python benchmarks/exact_attention_tune.py --out $OUT --bucket --stagger 256   # rows at different lengths
    python benchmarks/exact_attention_tune.py --out $OUT --bucket --cold-l2 256   # K/V from memory (bench_us)
    python benchmarks/exact_attention_tune.py --out $OUT --sweep     # the launch constants, below

``--sweep`` times exact mode's attention under each setting of the constants that fix its bits (key tile
``ATTN_BLOCK_N``, split size ``ATTN_SPLIT_KEYS``) and of its launch (warps, pipeline stages), on the shapes of
:data:`SWEEP_SHAPES`, and checks for each setting that every node of a 64-node tree and every token of a chain row
at 64 rows equals the AR step at its position (the property; a setting that breaks it is reported, never chosen).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
from pathlib import Path

import torch

from ddtree.engine.cuda_graphs import bucket_length
from ddtree.models.batch_invariant import attention_launch as bia
from ddtree.models.batch_invariant import attention_rules as rules
from ddtree.models.batch_invariant import attention_tables as tables
from ddtree.models.tree_attention import tree_attention
from ddtree.speculative.attention import pack_visibility

HEADS, KV, D = 32, 8, 128
COLD_L2_BYTES = 0  # --cold-l2: each timed call after writing this many bytes (bench_us); 0: replays as they come
# --stagger: rows start up to this many positions past the context (0: every row at the context, as before
# 2026-12-06 call K). Why: a tree whose start is a multiple of ATTN_SPLIT_KEYS has no shared key in the split that
# holds its tail, the best case of the split launch's chunk programs, which re-read that split's shared tiles; the
# engine's requests sit anywhere in a split (at C = 8 the engine's rounds took 68 us a call where the tune at a
# 1024 start timed 51-56, and rules the tune favoured did not move the engine's verify: calls I and J).
STAGGER = 0


def bench_us(fn, rep: int = 100) -> float:
    """Microseconds per call of ``fn`` in CUDA-graph replays (``do_bench_cudagraph``, median). With
    :data:`COLD_L2_BYTES` each replay first writes a buffer that size (twice the L2 or more evicts the K/V a replay
    leaves there), and the writes' own time, timed alone, is taken off: in the engine's rounds a layer's attention
    reads K/V that the layers' weights have pushed out of the L2 since, while plain replays of one call find the
    last replay's K/V there (a C = 8 tree of 17 nodes reads about 40 MB of keys and values; the H100's L2 is 50
    MB). Why: at C = 8 exact attention timed 55 us here and 68 in the engine's rounds (docs/benchmarks.md, "Exact
    mode", calls E-H); the cause is not measured."""
    from triton.testing import do_bench_cudagraph

    if not COLD_L2_BYTES:
        return round(do_bench_cudagraph(fn, rep=rep) * 1e3, 1)
    flush = torch.empty(COLD_L2_BYTES // 4, dtype=torch.int32, device="cuda")
    both = do_bench_cudagraph(lambda: (flush.zero_(), fn()), rep=rep)
    alone = do_bench_cudagraph(flush.zero_, rep=rep)
    return round((both - alone) * 1e3, 1)
SHAPES = (  # (name, rows, tokens, tree? (False: a chain, True: random, "served": DDTree's), context)
    ("AR C=1", 1, 1, False, 1024), ("chain C=1", 1, 16, False, 1024), ("tree 17 C=1", 1, 17, True, 1024),
    ("tree 64 C=1", 1, 64, True, 1024), ("AR C=64", 64, 1, False, 1024), ("tree 9 C=64", 64, 9, True, 1024),
    ("chain C=64", 64, 16, False, 1024), ("AR C=1 4k", 1, 1, False, 4096), ("tree 64 C=1 4k", 1, 64, True, 4096),
    ("tree 16 C=64", 64, 16, True, 1024), ("tree 9 C=8", 8, 9, True, 1024),
    # DDTree's own trees (served_trees), deeper than the random ones
    ("served tree 9 C=64", 64, 9, "served", 1024), ("served tree 16 C=64", 64, 16, "served", 1024),
    ("served tree 64 C=8", 8, 64, "served", 1024),
    # one request, where the split launch runs a tree's tail one program per chunk (2026-12-06)
    ("served tree 17 C=1", 1, 17, "served", 1024), ("served tree 32 C=1", 1, 32, "served", 1024),
    ("served tree 64 C=1", 1, 64, "served", 1024), ("served tree 32 C=1 4k", 1, 32, "served", 4096),
    ("served tree 64 C=1 4k", 1, 64, "served", 4096),
)


SWEEP_SHAPES = (
    ("AR C=1", 1, 1, False, 1024), ("tree 17 C=1", 1, 17, True, 1024), ("tree 64 C=1", 1, 64, True, 1024),
    ("AR C=64", 64, 1, False, 1024), ("tree 5 C=64", 64, 5, True, 1024), ("tree 9 C=64", 64, 9, True, 1024),
    ("chain C=64", 64, 16, False, 1024), ("AR C=1 4k", 1, 1, False, 4096), ("tree 64 C=1 4k", 1, 64, True, 4096),
)
# (ATTN_BLOCK_N, ATTN_SPLIT_KEYS, ATTN_NUM_WARPS, ATTN_NUM_STAGES): every combination below
SWEEP = tuple((bn, sk, w, st) for bn in (64, 128) for sk in (256, 512) for w in (4, 8) for st in (2, 3, 4))


def served_trees(rows: int, t: int, gen: torch.Generator, top_prob_boost: float = 10.0):
    """DDTree's trees of ``t`` nodes (``speculative.build_trees`` at top-k 8, 15 depths) over random drafter logits
    of 256 tokens whose top token has a mean probability of about 0.7 (logits N(0, 2.5) plus ``top_prob_boost`` on
    one token a depth): best-first trees, deeper than :func:`random_trees`' (docs/benchmarks.md, "Exact mode",
    ninth run: 0.38 tail chunks per query at 9-16 nodes). -> (depths [R, T], visibility [R, T, T])."""
    from ddtree import speculative

    logits = torch.randn((rows, 15, 256), generator=gen) * 2.5
    top = torch.randint(256, (rows, 15, 1), generator=gen)
    logits.scatter_add_(2, top, torch.full((rows, 15, 1), top_prob_boost))
    trees = speculative.build_trees(logits, t - 1, 8, max_budget=t - 1, root_tokens=torch.zeros(rows, dtype=torch.long))
    return trees.depths, trees.visibility


def random_trees(rows: int, t: int, tree: bool | str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths [R, T], visibility [R, T, T] with the diagonal): chains (``tree`` False), random trees of depth <= 15
    (True: each node's parent drawn among the shallower ones), or DDTree's own ("served": :func:`served_trees`)."""
    if tree == "served":
        return served_trees(rows, t, gen)
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


def inputs(rows: int, t: int, tree: bool, ctx: int, gen: torch.Generator, bucket: bool = False) -> dict:
    """Random K/V, queries and trees of one shape on the GPU. ``bucket``: the kernels get the key-length bound the
    engine's graphs launch with (``cuda_graphs.bucket_length``: 2048 for a 1k context), not the exact one."""
    dev = torch.device("cuda")
    kv_len = bucket_length(ctx + STAGGER + t, 1 << 30) if bucket else ctx + STAGGER + t
    k = torch.randn((rows + 1, KV, kv_len + 64, D), generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(k.shape, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn((rows, t, HEADS, D), generator=gen).to(dev, torch.bfloat16).transpose(1, 2)
    slots = torch.arange(rows, device=dev)
    start = torch.full((rows,), ctx, dtype=torch.long, device=dev)
    if STAGGER:  # rows at different lengths, as requests are in the engine's rounds (row 0 stays at ctx)
        start[1:] += torch.randint(0, STAGGER, (rows - 1,), generator=gen).to(dev)
    depth, vis = random_trees(rows, t, tree, gen)
    depth, vis = depth.to(dev), vis.to(dev)
    positions = start[:, None] + depth
    anc, chain = tables.ancestor_map(start, positions, vis)
    tail = tables.tail_chunks(anc, positions, start, HEADS // KV, KV)
    return dict(q=q, k=k, v=v, slots=slots, start=start, depth=depth, vis=vis, positions=positions, anc=anc,
                chain=chain, tail=tail, kv_len=kv_len, ctx=ctx, t=t)


def nodes_equal_to_ar(x: dict, out: torch.Tensor) -> str:
    """How many of row 0's tokens in ``out`` (exact mode's [R, H, T, D]) have the bits of the AR step at their
    position: one query over the same keys, written in position order at positions ``ctx ..``."""
    q, k, v, depth, vis, ctx, t = x["q"], x["k"], x["v"], x["depth"], x["vis"], x["ctx"], x["t"]
    dev = q.device
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
        a1, c1 = tables.ancestor_map(s1, p1, one)
        ar = bia.attention(q[:1, :, node:node + 1].contiguous(), k1, v1, x["slots"][:1], s1, p1, a1, c1, ctx + d + 1,
                          split_keys=rules.ATTN_SPLIT_KEYS)
        same += bool(torch.equal(ar[0, :, 0], out[0, :, node]))
    return f"{same}/{t}"


def default_call(x: dict):
    """The default engine's tree-attention kernel on one shape's inputs, as a call to time, with the visibility
    packed once beforehand as the engine's forwards pass it (``TreeVisibility.with_packed``: once a forward, not
    once a layer). Before 2026-12-06 (call J) the tune left the packing to each call, whose small ops took about
    half of the default column at C = 8 (60 us there against 30 a call in the engine's rounds)."""
    packed = pack_visibility(x["vis"])
    return lambda: tree_attention(x["q"], x["k"], x["v"], x["slots"], x["start"], x["vis"], x["kv_len"],
                                  packed=packed)


def exact_call(x: dict, module=None, **launch):
    """``module.attention`` (this tree's exact attention, or a ``--ref`` copy) on one shape's inputs, at the split
    size the module's constant says (the sweep changes it); ``launch``: ``fused=`` for this tree's. This tree's
    gets the forward's tail table made once (``tail_chunks``), as the engine passes it, and so does a ``--ref`` copy
    that takes one (a copy from before the table has no such argument)."""
    attention, split_keys = ((bia.attention, rules.ATTN_SPLIT_KEYS) if module is None
                             else (module.attention, module.ATTN_SPLIT_KEYS))
    if "tail" in inspect.signature(attention).parameters:
        launch = {"tail": x["tail"], **launch}
    return lambda: attention(x["q"], x["k"], x["v"], x["slots"], x["start"], x["positions"], x["anc"],
                             x["chain"], x["kv_len"], split_keys=split_keys, **launch)


def one_shape(name: str, rows: int, t: int, tree: bool, ctx: int, ref, gen: torch.Generator,
              bucket: bool = False) -> dict:
    """Time every kernel on one shape (and, for the 64-node tree, check each node against its AR step)."""
    x = inputs(rows, t, tree, ctx, gen, bucket)
    single = tables.single_chunks(rows, t, HEADS // KV, x["q"].device, KV)
    calls = {"default": default_call(x), "exact": exact_call(x), "exact_single": exact_call(dict(x, tail=single)),
             "exact_split": exact_call(x, fused=False),
             "exact_fused": exact_call(x, fused=True), "exact_fused_s3": exact_call(x, fused=True, num_stages=3)}
    if ref is not None:
        calls["exact_ref"] = exact_call(x, ref)
    row = {"shape": name, "rows": rows, "tokens": t, "context": ctx, "kv_len": x["kv_len"]}
    outs = {}
    for label, fn in calls.items():
        outs[label] = fn().clone()
        row[f"{label}_us"] = bench_us(fn)
    # the forward's table itself (once per forward, not per layer): grouped, or a chunk per query
    for label, fn in (("tail_chunks", lambda: tables.tail_chunks(x["anc"], x["positions"], x["start"], HEADS // KV, KV)),
                      ("single_chunks", lambda: tables.single_chunks(rows, t, HEADS // KV, x["q"].device, KV))):
        row[f"{label}_us"] = bench_us(fn)
    row["groups_tails"] = rules.groups_tails(rows, t, HEADS // KV, KV)
    row["single_same_bits"] = bool(torch.equal(outs["exact"], outs["exact_single"]))
    row["fused_same_bits"] = bool(torch.equal(outs["exact_split"], outs["exact_fused"])
                                  and torch.equal(outs["exact_fused"], outs["exact_fused_s3"]))
    if ref is not None:
        row["ref_same_bits"] = bool(torch.equal(outs["exact"], outs["exact_ref"]))
    if tree:  # each node of row 0 against the AR step at its position over the same keys
        row["nodes_equal_to_ar"] = nodes_equal_to_ar(x, outs["exact"])
    return row


def sweep(gen: torch.Generator, settings: tuple[tuple[int, int, int, int], ...] = SWEEP) -> dict:
    """Every setting of ``settings`` (:data:`SWEEP` unless ``--settings`` names others) on :data:`SWEEP_SHAPES`
    (module docstring); the default kernel once a shape."""

    shapes = [(name, inputs(rows, t, tree, ctx, gen)) for name, rows, t, tree, ctx in SWEEP_SHAPES]
    default = {name: bench_us(default_call(x)) for name, x in shapes}
    print("default:", " | ".join(f"{n}={us}" for n, us in default.items()), flush=True)
    kept = (rules.ATTN_BLOCK_N, rules.ATTN_SPLIT_KEYS, rules.ATTN_NUM_WARPS, rules.ATTN_NUM_STAGES)
    results = []
    for setting in settings:
        rules.ATTN_BLOCK_N, rules.ATTN_SPLIT_KEYS, rules.ATTN_NUM_WARPS, rules.ATTN_NUM_STAGES = setting
        row: dict = {"block_n": setting[0], "split_keys": setting[1], "num_warps": setting[2],
                     "num_stages": setting[3]}
        try:
            for name, x in shapes:
                fn = exact_call(x)
                out = fn().clone()
                row[name] = bench_us(fn, rep=50)
                if name in ("tree 64 C=1", "chain C=64"):
                    row[f"{name} =AR"] = nodes_equal_to_ar(x, out)
        except Exception as exc:  # a launch the device refuses (shared memory): recorded, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(row)
        print(" | ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    rules.ATTN_BLOCK_N, rules.ATTN_SPLIT_KEYS, rules.ATTN_NUM_WARPS, rules.ATTN_NUM_STAGES = kept
    return {"default_us": default, "settings": results}


LARGE_SHAPES = (  # trees of more than 64 folded rows at G = 4, as served (the engine's rule from this table:
    # ATTN_LARGE_BLOCK_M past 128 folded rows where that grid launches fused; the C = 1 shapes keep 32), then the
    # served trees of 9-32 nodes at 1-64 rows and the chain, where 16-row programs were timed too (2026-12-06; before
    # git a9ced78 the "rule" column of every shape after the first timed the previous shape's last override)
    ("tree 17 C=1", 1, 17, True, 1024), ("served tree 32 C=1", 1, 32, "served", 1024),
    ("served tree 64 C=1", 1, 64, "served", 1024), ("served tree 32 C=8", 8, 32, "served", 1024),
    ("served tree 64 C=8", 8, 64, "served", 1024), ("served tree 32 C=1 4k", 1, 32, "served", 4096),
    ("served tree 17 C=1", 1, 17, "served", 1024), ("served tree 64 C=1 4k", 1, 64, "served", 4096),
    ("served tree 9 C=64", 64, 9, "served", 1024), ("served tree 17 C=64", 64, 17, "served", 1024),
    ("chain C=1", 1, 16, False, 1024), ("chain C=64", 64, 16, False, 1024),
    ("chain C=8", 8, 16, False, 1024), ("served tree 9 C=8", 8, 9, "served", 1024),
    ("served tree 17 C=16", 16, 17, "served", 1024), ("served tree 17 C=32", 32, 17, "served", 1024),
    ("served tree 32 C=64", 64, 32, "served", 1024), ("served tree 17 C=8", 8, 17, "served", 1024),
)


def engine_tail(x: dict) -> torch.Tensor:
    """The tail table the engine's forward passes for these inputs under the module's rule as it is now
    (``attention_tables.forward_tail``, as ``exact_forward`` calls it)."""
    return tables.forward_tail(x["anc"], x["positions"], x["start"], HEADS // KV, KV)


def large_block_m(values: tuple[int, ...], gen: torch.Generator, warps: tuple[int, ...] = (),
                  only: tuple[str, ...] = ()) -> dict:
    """Exact attention on :data:`LARGE_SHAPES` at the engine's key buckets in programs of each of ``values`` rows
    (``attention_block_m`` replaced for the call; "auto": the launch the grid-size rule picks, and both launches
    forced), each output against the one at 32-row programs (a launch choice must keep every bit); the default
    kernel once a shape. us per call. The engine's rule (ATTN_LARGE_BLOCK_M) came from this table. ``warps``: for
    programs of 64 rows and more, also with these warps a program (``ATTN_NUM_WARPS`` replaced; columns
    ``m{rows}w{warps}_*``): a served 17-node tree at C = 64 (68 folded rows) takes two 64-row programs a row and KV
    head, the second holding one query and re-reading the prefix, where one 128-row program would read it once.
    ``only``: the shapes whose names are listed (all when empty). The ``m{rows}`` columns run without small last
    tiles (their meaning before those existed), ``m{rows}s`` with them (``attention_small_tail``); ``old_us`` is
    the engine's rule without them. (Calls I-K of 2026-12-06 also timed extra rows, one program of 64 + 16 rows
    for a 17-node tree, columns ``x16w{warps}_*``, at git 81d089b; removed after.)"""

    rule = rules.attention_block_m  # the engine's rule, replaced here by "value rows past min(value, 64) folded rows"
    rows_out = []
    for name, rows, t, tree, ctx in LARGE_SHAPES:
        if only and name not in only:
            continue
        rules.attention_block_m = rule  # the engine's own for "rule" (and the inputs' tail table)
        x = inputs(rows, t, tree, ctx, gen, bucket=True)
        x["tail"] = engine_tail(x)
        row = {"shape": name, "default_us": bench_us(default_call(x)),
               "rule_block_m": rule(t, HEADS // KV, rows * KV), "rule_us": bench_us(exact_call(x))}
        kept_small = rules.ATTN_SMALL_TAIL_ROWS
        rules.ATTN_SMALL_TAIL_ROWS = 0
        x["tail"] = engine_tail(x)
        row["old_us"] = bench_us(exact_call(x))  # the rule before small last tiles
        ref = None
        kept_warps, kept_wide = rules.ATTN_NUM_WARPS, rules.ATTN_WIDE_WARPS
        runs = [(v, kept_warps, f"m{v}", 0) for v in (32, *[v for v in values if v != 32])]
        runs += [(v, kept_warps, f"m{v}s", 16) for v in (32, *[v for v in values if v != 32])]
        runs += [(v, w, f"m{v}w{w}", 0) for v in values if v >= 64 for w in warps if w != kept_warps]
        for value, num_warps, name, small in runs:
            rules.ATTN_SMALL_TAIL_ROWS = small
            rules.attention_block_m = (lambda tokens, group, per_tile=1, value=value:
                                    value if tokens * group > min(value, 64) else rule(tokens, group, per_tile))
            rules.ATTN_NUM_WARPS = rules.ATTN_WIDE_WARPS = num_warps  # every program of the call (attention_warps)
            x["tail"] = engine_tail(x)
            for label, launch in (("auto", {}), ("split", {"fused": False}), ("fused", {"fused": True})):
                fn = exact_call(x, **launch)
                try:
                    out = fn().clone()
                    ref = out if ref is None else ref
                    row[f"{name}_{label}_us"] = bench_us(fn)
                    if not torch.equal(out, ref):
                        row[f"{name}_{label}_bits"] = "DIFFER"
                except Exception as exc:  # a launch the device refuses (shared memory): recorded
                    row[f"{name}_{label}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rules.ATTN_NUM_WARPS, rules.ATTN_WIDE_WARPS = kept_warps, kept_wide
        rules.ATTN_SMALL_TAIL_ROWS = kept_small
        rows_out.append(row)
        print(" | ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    rules.attention_block_m = rule
    return {"rows": rows_out, "values": list(values)}


def tail_rows_table(values: tuple[int, ...], gen: torch.Generator, only: tuple[str, ...] = ()) -> dict:
    """Exact attention on :data:`LARGE_SHAPES` (rows staggered by ``--stagger``) with the tail chunks' dots of each
    of ``values`` rows (``attention_rules.tail_rows`` replaced, so a chunk holds rows // G queries of one path and
    the forward's table is laid out for it), each output against the engine's (a launch choice must keep every
    bit), with the chunks a program runs on average. Why: in the fused launch a program's chunks run one after
    another, each a gathered K and V tile or two and three dots; a served tree's long path in chunks of 4 queries
    takes several, where wider chunks take one (at the cost of dots of more padding rows for the short paths)."""
    rule = rules.tail_rows
    rows_out = []
    for name, rows, t, tree, ctx in LARGE_SHAPES:
        if only and name not in only:
            continue
        x = inputs(rows, t, tree, ctx, gen, bucket=True)
        x["tail"] = engine_tail(x)
        ref = exact_call(x)().clone()
        row = {"shape": name, "default_us": bench_us(default_call(x)), "engine_us": bench_us(exact_call(x)),
               "fused": rules.launches_fused(t, HEADS // KV, rows * KV)}
        for value in values:
            rules.tail_rows = lambda group, value=value: max(value, rule(group))
            try:
                x["tail"] = engine_tail(x)
                fn = exact_call(x)
                out = fn().clone()
                row[f"t{value}_us"] = bench_us(fn)
                row[f"t{value}_chunks"] = round(float(x["tail"][..., 0].float().mean()), 2)
                if not torch.equal(out, ref):
                    row[f"t{value}_bits"] = "DIFFER"
            except Exception as exc:  # a launch the device refuses (shared memory): recorded
                row[f"t{value}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            finally:
                rules.tail_rows = rule
        rows_out.append(row)
        print(" | ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    return {"rows": rows_out, "values": list(values), "stagger": STAGGER}


def parse_settings(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """``"64:512:4:2,64:1024:4:2"`` -> ((64, 512, 4, 2), (64, 1024, 4, 2)); a split that is not a multiple of its
    tile is refused here, before any kernel runs."""
    settings = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--settings: {item!r} is not block_n:split_keys:warps:stages (four positive integers)")
        bn, sk, w, st = (int(p) for p in parts)
        if sk % bn:
            raise SystemExit(f"--settings: split_keys {sk} is not a multiple of block_n {bn} in {item!r}")
        settings.append((bn, sk, w, st))
    return tuple(settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", default=None, help="a single-file batch_invariant.py (before the package) to time beside this tree's")
    ap.add_argument("--sweep", action="store_true", help="time every setting of the attention's constants instead")
    ap.add_argument("--bucket", action="store_true", help="launch at the engine's key-length buckets (2048 for "
                    "1k), not at the exact key count (the table only, not --sweep)")
    ap.add_argument("--settings", default=None, help="with --sweep: these settings instead of SWEEP, as "
                    "block_n:split_keys:warps:stages,... (for example 64:512:4:2,64:1024:4:2)")
    ap.add_argument("--large-block-m", default=None, help="time trees of more than 64 folded rows with their "
                    "programs at these row counts instead (attention_block_m), for example 16,32,64")
    ap.add_argument("--large-warps", default=None, help="with --large-block-m: programs of 64 rows and more also "
                    "with these warps each, for example 8")
    ap.add_argument("--shapes", default=None, help="with --large-block-m: only these shapes of LARGE_SHAPES, "
                    "comma-separated names (for example 'served tree 17 C=64,chain C=64')")
    ap.add_argument("--tail-rows", default=None, help="time the tail chunks' dots at these row counts (e.g. "
                    "16,32,64) on LARGE_SHAPES (or --shapes), at the engine's key buckets")
    ap.add_argument("--stagger", type=int, default=0, metavar="N",
                    help="rows start at the context plus 0 to N - 1 positions (row 0 at the context): requests at "
                         "different lengths, as in the engine's rounds; 0: all at the context")
    ap.add_argument("--cold-l2", type=int, default=0, metavar="MB",
                    help="write this many MB before each timed call and take the writes' time off (bench_us): "
                         "K/V read from memory, as in the engine's rounds, not from the last replay's L2; 0: off")
    args = ap.parse_args()
    global COLD_L2_BYTES, STAGGER
    if args.stagger < 0:
        ap.error(f"--stagger: positions >= 0, got {args.stagger}")
    STAGGER = args.stagger
    if args.cold_l2 < 0:
        ap.error(f"--cold-l2: megabytes >= 0, got {args.cold_l2}")
    COLD_L2_BYTES = args.cold_l2 * 2**20
    if args.large_warps is not None:
        if args.large_block_m is None:
            ap.error("--large-warps times the programs of --large-block-m; pass --large-block-m with it")
        if not all(v.isdigit() and int(v) in (1, 2, 4, 8, 16) for v in args.large_warps.split(",")):
            ap.error(f"--large-warps: warps among 1, 2, 4, 8, 16, got {args.large_warps}")
    if args.shapes is not None and args.large_block_m is None and args.tail_rows is None:
        ap.error("--shapes picks shapes of --large-block-m or --tail-rows; pass one of them with it")
    if args.settings is not None and not args.sweep:
        ap.error("--settings names settings for --sweep; pass --sweep with it")
    if args.bucket and args.sweep:
        ap.error("--bucket times the table of SHAPES; --sweep keeps exact key counts")
    settings = SWEEP if args.settings is None else parse_settings(args.settings)
    ref = load_ref(args.ref) if args.ref else None
    gen = torch.Generator().manual_seed(0)
    if args.tail_rows is not None:
        values = tuple(int(v) for v in args.tail_rows.split(","))
        if any(v not in (16, 32, 64) for v in values):
            ap.error(f"--tail-rows: values among 16, 32, 64, got {args.tail_rows}")
        only = tuple(v.strip() for v in args.shapes.split(",")) if args.shapes else ()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "exact_attention_tail_rows.json").write_text(json.dumps(tail_rows_table(values, gen, only), indent=1))
        return
    if args.large_block_m is not None:
        values = tuple(int(v) for v in args.large_block_m.split(","))
        if any(v not in (16, 32, 64, 128) for v in values):
            ap.error(f"--large-block-m: values among 16, 32, 64, 128, got {args.large_block_m}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        warps = tuple(int(v) for v in args.large_warps.split(",")) if args.large_warps else ()
        only = tuple(v.strip() for v in args.shapes.split(",")) if args.shapes else ()
        unknown = [v for v in only if v not in {shape[0] for shape in LARGE_SHAPES}]
        if unknown:
            ap.error(f"--shapes: {unknown} not among LARGE_SHAPES ({', '.join(s[0] for s in LARGE_SHAPES)})")
        (out / "exact_attention_large_block_m.json").write_text(json.dumps(large_block_m(values, gen, warps, only),
                                                                           indent=1))
        return
    if args.sweep:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "exact_attention_sweep.json").write_text(json.dumps(sweep(gen, settings), indent=1))
        return
    rows_out = []
    for shape in SHAPES:
        row = one_shape(*shape, ref, gen, args.bucket)
        rows_out.append(row)
        print(" | ".join(f"{key}={val}" for key, val in row.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "exact_attention_tune_bucket.json" if args.bucket else "exact_attention_tune.json"
    (out / name).write_text(json.dumps({"rows": rows_out, "bucket": args.bucket}, indent=1))


if __name__ == "__main__":
    main()
