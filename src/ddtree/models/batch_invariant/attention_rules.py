"""Exact mode's attention launch rules: the tunable constants and the functions that read them.

Every choice here is a launch choice (how many folded rows a program takes, fused or split, warps, stages, small
last tiles), never a bit-fixing one, except the tile and split sizes in key positions (``ATTN_BLOCK_N``,
``ATTN_SPLIT_KEYS``), which fix the order of every query's sums (the package docstring). They live in one module so
that the tuning scripts and the tests that set a constant (``monkeypatch.setattr(attention_rules, "ATTN_...", v)``)
change every rule that reads it; code elsewhere reads them as ``attention_rules.NAME``, never by a copied import.
"""

from __future__ import annotations

from ddtree.models.batch_invariant.matmul import pow2_at_least

# ---- constants (changing one changes exact mode's bits, never its invariance) --------------------------------------
ATTN_BLOCK_M = 32  # folded rows (queries x query heads of one KV head) per attention program (64: attention_block_m)
# folded rows per program for trees of more than ATTN_LARGE_MIN_FOLDED folded rows whose grid then still launches
# fused (attention_block_m): a launch choice. The tail is gathered per chunk of queries, so wider programs read the
# shared prefix fewer times: a served 64-node tree at C = 8 102 against 135 us; at C = 1 (split launch) 50 against
# 36, and 128-row programs slower everywhere (H200, docs/benchmarks.md, "Exact mode", tenth run). From 64 folded
# rows up (a tree of 17-32 nodes at G = 4) since 2026-12-06: a served 17-node tree at C = 64 279 against 322 us in
# 32-row programs, 32 nodes 345 against 463, while at C = 8 (no fused 64-row grid) 32 rows stay (H200 and H100,
# docs/benchmarks.md, "Exact mode").
ATTN_LARGE_BLOCK_M = 64
ATTN_LARGE_MIN_FOLDED = 64
# Wide programs, off (ATTN_WIDE_MAX_PER_TILE 0): one program for a whole tree of 17-32 nodes at G = 4 (65-128 folded
# rows) where a call has ATTN_WIDE_MIN_PER_TILE to ATTN_WIDE_MAX_PER_TILE programs per query tile (rows x KV heads),
# run with ATTN_WIDE_WARPS warps (4 lost everywhere: the tenth run) and fused when ATTN_WIDE_FUSED. Why they stay
# off (H100, docs/benchmarks.md "Exact mode", calls E and G of 2026-12-06): a served 17-node tree's 68 rows fill 53 %
# of the program; at C = 16 it is faster fused (86 us against 93-95 in 64-row programs), at C = 8 slower (74 fused,
# 67 split, against 55), and DDTree 16 at C = 8 in the engine took 9-11 % longer exact rounds with them; C = 16 was not
# priced. Launch choices (the test compares their bits), kept for the tune and the price script.
ATTN_WIDE_BLOCK_M = 128
ATTN_WIDE_WARPS = 8
ATTN_WIDE_MIN_PER_TILE = 64
ATTN_WIDE_MAX_PER_TILE = 0
ATTN_WIDE_FUSED = True
# Small last tiles: where a call's queries fill several programs and the last holds at most ATTN_SMALL_TAIL_ROWS
# folded rows (DDTree 16's 17th node at G = 4: 4 rows in a 64- or 32-row program), that program runs as one of
# ATTN_SMALL_TAIL_ROWS rows (attention_small_tail): the same rows, without the padding rows' dots. 0: off. A launch
# choice (the tests compare its bits). A served 17-node tree with rows at different lengths (H100, docs/benchmarks.md
# "Exact mode", 2026-12-06 call K): C = 64 293 against 317 us, C = 8 71 against 73, C = 16 92 against 94, C = 1 the
# same; DDTree 16's exact verify stage in the engine did not move beyond its spread (call J).
ATTN_SMALL_TAIL_ROWS = 16
ATTN_SUM_COLS = 16  # columns of the ones matrix the tile's row sums are a dot with (a tensor-core dot's least N)
ATTN_BLOCK_N = 64  # key positions per tile
ATTN_SPLIT_KEYS = 256  # key positions per split (a multiple of ATTN_BLOCK_N); 512 served slower (benchmarks.md)
ATTN_FUSED_MIN_PROGRAMS = 256  # grids this large launch fused (attention_fused): about two per SM of an H200
# The attention kernel's launch (warps, software-pipeline stages): the same for every call, so never a source of a
# row's difference between calls; benchmarks/exact_attention_tune.py --sweep times the alternatives on the H200.
ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
ATTN_FUSED_ONE_TOKEN_STAGES = 3  # attention_stages
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def tail_rows(group: int) -> int:
    """Rows of a tail tile's dot in the fused launch: at least a tensor-core tile (16), at least G."""
    return pow2_at_least(group, 16)


def tail_layout(tokens: int, group: int, per_tile: int = 1) -> tuple[int, int]:
    """(queries per attention program QT, queries per tail chunk) for ``tokens`` new tokens of ``group`` query
    heads per KV head in a call of ``per_tile`` = rows x KV heads programs per query tile: the shape
    :func:`tail_chunks` lays its table out in."""
    return attention_block_m(tokens, group, per_tile) // group, tail_rows(group) // pow2_at_least(group, 1)


def attention_block_m(tokens: int, group: int, per_tile: int = 1) -> int:
    """Folded rows per attention program for ``tokens`` new tokens of ``group`` query heads per KV head, in a call
    of ``per_tile`` programs per query tile (rows x KV heads): 64 where that puts every token of a row in one program
    (a chain of 16 or a tree of 9-16 nodes at G = 4: each program reads its keys once, not twice);
    :data:`ATTN_LARGE_BLOCK_M` for more than :data:`ATTN_LARGE_MIN_FOLDED` folded rows where that grid still
    launches fused (:func:`attention_fused`: a tree of 64 at C = 8 or of 17 at C = 64, whose programs then read the
    shared prefix half or two thirds as often); else :data:`ATTN_BLOCK_M`. A launch choice, not a bit-fixing one:
    a tensor-core dot's row depends on that row and the tile only, and the tile's reductions are dots or maxima
    (:func:`_softmax_step`); the GPU tests compare chain rows and tree nodes in 64-row programs with their AR steps
    in 32-row ones."""
    folded = tokens * group
    if folded <= ATTN_BLOCK_M:
        return ATTN_BLOCK_M
    if folded <= 64:
        return 64
    if folded <= ATTN_WIDE_BLOCK_M and ATTN_WIDE_MIN_PER_TILE <= per_tile <= ATTN_WIDE_MAX_PER_TILE:
        return ATTN_WIDE_BLOCK_M
    if folded > ATTN_LARGE_MIN_FOLDED and attention_fused(-(-tokens // (ATTN_LARGE_BLOCK_M // group)) * per_tile):
        return ATTN_LARGE_BLOCK_M
    return ATTN_BLOCK_M


def attention_small_tail(tokens: int, group: int, per_tile: int = 1) -> bool:
    """Whether a call's last query tile runs in a program of :data:`ATTN_SMALL_TAIL_ROWS` rows: where its queries
    fill more than one program of :func:`attention_block_m` rows and the last holds at most that many folded rows
    (the kernel tests the same per program). A launch choice, never a bit-fixing one (a tensor-core dot's row
    depends on that row and the tile only)."""
    qt = tail_layout(tokens, group, per_tile)[0]
    last = tokens - (-(-tokens // qt) - 1) * qt  # queries in the last tile
    return bool(ATTN_SMALL_TAIL_ROWS) and tokens > qt and last * group <= ATTN_SMALL_TAIL_ROWS


def launches_fused(tokens: int, group: int, per_tile: int) -> bool:
    """Whether a call of ``tokens`` new tokens of ``group`` query heads per KV head in ``per_tile`` = rows x KV
    heads programs per query tile launches fused: by its grid's size (:func:`attention_fused`), or in wide programs
    where :data:`ATTN_WIDE_FUSED`. A launch choice, never a bit-fixing one."""
    if attention_block_m(tokens, group, per_tile) == ATTN_WIDE_BLOCK_M and ATTN_WIDE_FUSED:
        return True
    return attention_fused(-(-tokens // tail_layout(tokens, group, per_tile)[0]) * per_tile)


def attention_warps(block_m: int) -> int:
    """Warps a program of ``block_m`` folded rows runs: :data:`ATTN_WIDE_WARPS` for wide programs, else
    :data:`ATTN_NUM_WARPS`. A launch choice."""
    return ATTN_WIDE_WARPS if block_m >= ATTN_WIDE_BLOCK_M else ATTN_NUM_WARPS


def attention_fused(programs: int) -> bool:
    """Whether the fused launch serves a call whose grid without splits has ``programs`` programs (query tiles x
    rows x KV heads): where they alone fill the device (:data:`ATTN_FUSED_MIN_PROGRAMS`), splits only add partials
    to write and read back (a chain at C = 64 over 1k keys wrote 134 MB and read 84 MB of them for 34 MB of K/V);
    below it the splits are what spread a long context over the SMs. A launch choice, never a bit-fixing one."""
    return programs >= ATTN_FUSED_MIN_PROGRAMS


def groups_tails(rows: int, tokens: int, group: int, kv_heads: int) -> bool:
    """Whether a forward of ``rows`` x ``tokens`` tree queries should group its tails (:func:`tail_chunks`) rather
    than give each query a chunk of its own (:func:`single_chunks`): where its calls launch fused
    (:func:`attention_fused`), whose programs run their chunks one after another. The split launch runs each chunk
    as a program of its own (:func:`_chunk_splits`), so there the grouping's ninety or so small ops a forward buy
    little. A speed choice: both tables give the same bits."""
    return launches_fused(tokens, group, rows * kv_heads)


def attention_stages(fused: bool, tokens: int) -> int:
    """Software-pipeline stages of a launch: :data:`ATTN_FUSED_ONE_TOKEN_STAGES` for the fused launch of one token
    per row (AR at C = 64: 75 against 85 us, H200, docs/benchmarks.md "Exact mode"), else :data:`ATTN_NUM_STAGES`
    (3 stages cost chains and trees 18-160 us there). A launch choice: the H200 run compared the bits."""
    return ATTN_FUSED_ONE_TOKEN_STAGES if fused and tokens == 1 else ATTN_NUM_STAGES


def supports_head_dim(head_dim: int) -> bool:
    """Head dims the Triton attention takes (one power-of-two block, at least a tensor-core tile)."""
    return head_dim in SUPPORTED_HEAD_DIMS
