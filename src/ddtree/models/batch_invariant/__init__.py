"""Batch-invariant kernels for exact mode: a matmul and an attention whose result for one token row does not depend
on how many rows ride along, where the row sits in the batch, the tree around it or the key-length bucket.

Why: cuBLAS picks its kernel (and split-K) by row count and the tree-attention kernel picks its tiles and context
splits by rows and ``kv_len``, so the same token gets logits 1-2 ulps apart in AR decoding, a chain, a tree or a
batch of 64, and bf16 near-ties flip (docs/benchmarks.md, "Divergence"; ``../shared/docs/gpu-facts.md``). Here every
reduction has one fixed order per output element (docs/architecture.md, "Exact mode"):

Matmul (:func:`linear`, x [M, K] @ w [N, K]^T)
    BLOCK_K and a split count S per weight shape (:func:`matmul_tiles`, from (N, K) only, never from M) fix each
    output element's order: S equal K segments, each summed from zero in ascending K order, the segments added in
    ascending order, the bias last. How the programs are laid out may follow M (:func:`matmul_launch`): split
    programs writing fp32 partials that a second kernel adds in order, or fused programs that walk the segments
    themselves (same bits, as 0 + s == s), in row and column tiles of any size (a tensor-core dot's row depends on
    that row and the K step only; the H200 run compared every launch), with tiles loaded through pointers or,
    on Hopper, through tensor descriptors (the same loads, :data:`MATMUL_LAUNCHES`). M is not specialised on
    (``do_not_specialize``): a row's result depends on its own inputs and the weight only.

Attention (:func:`attention`, new tokens over a KV-cache slot)
    Keys are walked in *position* order, in tiles of ``ATTN_BLOCK_N`` positions at fixed multiples of it, and split at
    fixed multiples of ``ATTN_SPLIT_KEYS`` positions; a query at position p combines splits 0 .. p // ATTN_SPLIT_KEYS
    in ascending order. Key position j of query t is cache index j below ``start`` (the committed prefix) and
    ``start + anc[t, j - start]`` above it (the node's ancestor at depth ``j - start``: in a tree the ancestors are not
    contiguous in the cache, :func:`ancestor_map`). A program's rows (32 or 64, :func:`attention_block_m`) = queries
    x the G query heads of one KV head. Where its queries share their keys (prefix tiles; every tile of a chain or a
    prompt chunk) one K/V tile serves them all; in a tree's tiles above that each chunk of queries on one path reads
    its deepest member's tile, which holds every member's keys (:func:`tail_chunks`; a tensor-core dot's row depends
    only on that row and the tile, whatever the dot's row count, and keys past a member's position are masked).
    Masked keys are exact no-ops (p = exp2(-inf) = 0; the running max is guarded against -inf - -inf). The splits'
    states are merged in ascending order into a running max and rescaled sums with explicit fma
    (:func:`_merge_weights`), either by a combine kernel over stored fp32 partials (the split launch: a program per
    split, :func:`_split_state`, and a tree's splits from ``start`` up a program per chunk, :func:`_chunk_splits`)
    or, where the grid fills the device without splits (:func:`attention_fused`), by each program itself in one loop
    over its tiles, a tree's tail tiles one chunk at a time (the fused launch, :func:`_fused_program`); a chunk's
    tiles run on 16-row dots (G rows where G > 16) in both: the same arithmetic, so the same bits.

Example: a tree root(0) -> a(1), root -> b(2), a -> c(3) at start 5, written at cache indices 5..8 with positions
5, 6, 6, 7. Query c (position 7) walks positions 0..7 and reads cache indices 0 1 2 3 4 5 6 8: exactly the keys AR
decoding of the same tokens reads at positions 0..7 (cache 0..7), in the same tiles and splits.

Each kernel has a torch path for devices Triton cannot run on (:func:`linear_rows`, :func:`attention_rows`): one
token row at a time, so every call has the shapes of a single row and is invariant by construction (slow; the CPU
tests and CPU exact mode use it). On CUDA exact mode needs Triton.

Modules: :mod:`.matmul` (rules, launch tables, :func:`linear`) and :mod:`.matmul_kernels`; :mod:`.attention_launch`
(:func:`attention`), :mod:`.attention_rules` (the launch rules and the constants they read),
:mod:`.attention_tables` (the index tables a forward makes once for its layers) and :mod:`.attention_kernels`. The
names below are re-exported for callers; a tuning script or test that sets a constant or replaces a function sets it
on the module that reads it (``attention_rules.ATTN_SMALL_TAIL_ROWS``, ``matmul.matmul_launch``), as a copy here
would change nothing.
"""

from ddtree.models.batch_invariant.attention_launch import attention, attention_rows
from ddtree.models.batch_invariant.attention_rules import SUPPORTED_HEAD_DIMS, groups_tails, supports_head_dim
from ddtree.models.batch_invariant.attention_tables import (
    ancestor_map,
    forward_tail,
    single_chunks,
    tail_chunks,
)
from ddtree.models.batch_invariant.matmul import (
    MatmulLaunch,
    MatmulTiles,
    linear,
    linear_rows,
    matmul_launch,
    matmul_tiles,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS", "MatmulLaunch", "MatmulTiles", "ancestor_map", "attention", "attention_rows", "forward_tail",
    "groups_tails", "linear", "linear_rows", "matmul_launch", "matmul_tiles", "single_chunks", "supports_head_dim",
    "tail_chunks",
]
