"""Per-row top-k tokens and log-normaliser of a logits matrix in one read of the row (a Triton kernel).

Why: tree building needs, for every draft depth, the K' most likely tokens and log q = logit - logsumexp(logits).
With torch that is a multi-pass radix ``topk``, a separate float32 ``logsumexp`` and, for bf16 logits, a float copy:
three passes over [R * L, V] whose cost grows with R. Here a first stage reads every logit once and leaves, per
piece of a row, the piece's top keys and a partial (max, sum of exp); a final stage merges the pieces of a row.

Order and ties
--------------
Every element becomes one distinct int64 key, ``ordered_bits(value) << 32 | (2**31 - 1 - token_id)``, where
``ordered_bits`` maps a float32 to an int32 with the same order. A larger key is a larger value, or an equal value
and a smaller token id, so selecting the k largest keys and sorting them descending gives the canonical candidate
order of :mod:`ddtree.speculative.tree` (log-prob desc, token id asc) with no re-ranking sort; when more than k tokens tie
at the k-th value the lowest ids enter. -0.0 is read as +0.0 (the two compare equal). Logits must not hold NaN or
+inf (a drafter never emits them); -inf entries and all -inf rows are fine (their logsumexp is -inf).

First-stage strategies
----------------------
``"running"`` (the default up to :data:`ddtree.tuning.RUNNING_MAX_K`): program (row, split) walks its contiguous range of
``chunk``-sized pieces of the row in one loop and keeps a running top list of K_PAD keys (K_PAD = k rounded up to a
power of two), an online logsumexp partial, and nothing else. Per piece it takes the piece's maximum (one block
reduction, which is also the logsumexp's running-max update); only when that maximum reaches the list's smallest
value does it build the piece's keys and move them in: ``while max(keys) > min(top)`` replace the list's minimum
by it and drop it from the piece. Keys are distinct (they hold the token id), so every equality mask hits one
element, and a piece inserts at most K_PAD keys. The list starts with K_PAD *distinct* pad keys below every real
key, so "replace the minimum" touches one slot from the first piece on. Worked example, k = 2, pieces of 4
(ids 0-3, 4-7, ...; "7@3" is value 7 at id 3, and of two equal values the lower id is the larger key)::

    piece 0  [3, 9, 1, 7]   max 9 >= -inf: insert 9@1, then 7@3 (each replaces a pad); top {9@1, 7@3}
    piece 1  [2, 5, 6, 0]   max 6 < 7: skipped after one reduction
    piece 2  [7, 1, 8, 2]   max 8 >= 7: 8@10 replaces 7@3; next 7@8 < 8@10: stop; top {9@1, 8@10}
    piece 3  [9, 0, 0, 9]   max 9 >= 8: 9@12 replaces 8@10; next 9@15 < 9@12: stop; top {9@1, 9@12}

Why this shape: the previous first stage took each 4096-entry chunk's top K_PAD by K_PAD block maximums, 16
reductions per chunk at k = 16, which made the kernel compute-bound (1.7 ms for 960 rows on an H200 against
~0.07 ms to read them). For a row in random order the k-th best of the first c pieces rises quickly, and a piece
holds one of the running top k with probability about k / c, so a whole row costs one reduction per piece plus
about k * ln(pieces) insertions. The sum of exp is kept per lane (a [chunk] accumulator, rescaled by one scalar
exp when the running max moves) and reduced once at the end, so it adds no reduction per piece. Small pieces make
insertions cheap (each is a reduction over one piece) and allow a small program (one warp for 512 entries: its
reductions are warp shuffles, with no shared-memory barrier); pieces c + 1 and c + 2 are loading while piece c is
processed, so each program keeps two loads in flight. ``splits`` programs per row (chosen from the row count so
that the whole GPU holds about :data:`ddtree.tuning.RUNNING_WARPS_PER_SM` warps per multiprocessor, at most :data:`MAX_SPLITS`)
give small batches enough parallelism; each split costs one more K_PAD-long warm-up and K_PAD more keys to merge. Worst cases stay
exact, only slower: an ascending row inserts K_PAD keys per piece (the old cost), an all-equal row builds keys for
every piece (equal values from later ids never enter).

``"extract"`` and ``"sort"``: one program per 4096-entry chunk, which takes its chunk's top K_PAD by K_PAD
repeated maximums or by ``tl.topk``'s bitonic network (about log2(k)^2 / 2 compare-exchange stages per element);
``"sort"`` is the default above :data:`ddtree.tuning.RUNNING_MAX_K` (of the two, the faster above k = 16 on the H200).

The logsumexp is float32 even for half-precision input, as ``torch.logsumexp(x.float())``; the two are not bit
equal (different summation order, and on a GPU ``tl.exp2`` is the hardware's approximate exp2): measured on the
H200 at V = 151,936 they agree to 2e-6 relative with the default chunks and splits, and to 3e-6 (3.6e-5 absolute)
with one program summing a whole row in 256-entry pieces. Every log-prob of a depth shifts by the same amount, so a
depth's ranking never changes; only scores across depths move by that much.

When it runs: ``build_trees(..., fast_topk=True)`` (the caller's choice) uses it for widths up to
:data:`ddtree.tuning.FAST_MAX_K`, wide lists only for few enough rows (:func:`ddtree.tuning.kernel_takes`: the
H200's tuning table), when :func:`available` -
:func:`ddtree.triton_runtime.can_run` (a CUDA tensor; a CPU tensor only under Triton's interpreter inside
``triton_runtime.cpu_interpreter()``, which tests use) and a supported dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ddtree import tuning
from ddtree.errors import ConfigError, ShapeError
from ddtree.triton_runtime import FP_FUSION, can_run, masked_if, tl, triton

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STRATEGIES = ("running", "extract", "sort")
# The H200's tuning tables (when build_trees uses the kernel: tuning.kernel_takes with FAST_MAX_K and FAST_MAX_WORK;
# the default strategy's threshold RUNNING_MAX_K; the "running" strategy's piece size, warps and occupancy target)
# live in ddtree.tuning; below are the kernel's own limits.
MAX_SPLITS = 32  # at most this many programs per row (each adds a warm-up and K_PAD keys to the final merge)
# The split rule's multiprocessor count off CUDA: Triton's interpreter runs programs one after another, so there is
# nothing to fill, and every extra split only adds a warm-up (tests force splits explicitly).
FALLBACK_SM_COUNT = 1
MERGE_BLOCK = 8192  # candidate keys one merge program selects from (bounds its registers)
MAX_VOCAB = 2**30  # token ids and chunk offsets stay far from int32 overflow


def available(t: Tensor) -> bool:
    """Whether :func:`topk_logsumexp` can run on ``t``: a Triton kernel can run on its device
    (:func:`ddtree.triton_runtime.can_run`) and its dtype is one the kernel reads."""
    return t.dtype in SUPPORTED_DTYPES and can_run(t)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _is_pow2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: a host-side property, safe during graph capture)."""
    if device.type != "cuda":
        return FALLBACK_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits(rows: int, chunks: int, warps: int, sm_count: int) -> int:
    """Programs per row for strategy "running": enough for ``RUNNING_WARPS_PER_SM`` warps on each of ``sm_count``
    multiprocessors in total, at most ``MAX_SPLITS`` and never more than the row's ``chunks`` pieces.

    E.g. an H200 (132 SMs), one-warp programs over 297 pieces: 15 rows (a single request) -> 32 splits,
    960 rows (64 requests x 15 depths) -> 2 (1920 programs, ~15 per SM, fewer than fit at once: a program of
    512-entry pieces takes ~108 registers a lane, so ~18 one-warp programs fit on a multiprocessor; rounding the
    count up instead would leave a second, mostly empty wave). Host ints only: it can run during graph capture."""
    wanted = tuning.RUNNING_WARPS_PER_SM * sm_count // (max(rows, 1) * warps)  # rounded down: all resident at once
    return max(1, min(chunks, MAX_SPLITS, wanted))


def topk_logsumexp(
    logits: Tensor,
    k: int,
    *,
    strategy: str | None = None,
    chunk: int | None = None,
    splits: int | None = None,
    warps: int | None = None,
    merge_block: int = MERGE_BLOCK,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` largest logits of every row (value desc, token id asc) and every row's logsumexp.

    logits: [M, V] float32, bfloat16 or float16 (rows need not be contiguous to each other; the vocab dim is made
        contiguous if it is not). k: 1 <= k <= V.
    strategy: the first stage (see the module docstring): "running", "extract" or "sort"; None = "running" up to
        ``RUNNING_MAX_K``, "sort" above. Same results whichever runs. The other arguments but ``out`` are tuning
        and test knobs:
    chunk: a power of two >= k rounded up to a power of two, at most 65536: vocabulary entries per loop step
        ("running", default ``RUNNING_CHUNK``) or per program (default ``DEFAULT_CHUNK``); the whole row when smaller.
    splits: "running" only: programs per row (at most 65535), each over a contiguous range of cdiv(chunks, splits)
        pieces (the last ones may own none); default :func:`default_splits`.
    warps: the first stage's num_warps (1, 2, 4, 8 or 16); default one per ``RUNNING_ENTRIES_PER_WARP`` entries
        ("running", at most 8), else 8 for chunks of 4096 or more and 4 below.
    merge_block: most candidate keys one merge program selects from (a power of two >= 2 * k rounded up); when
        the first stage leaves more lists, extra merge passes run first.
    out: optional preallocated (values [M, k] float32, ids [M, k] long, lse [M] float32; the [M, k] ones with a
        contiguous last dim), written in full and nothing else.

    Returns (values [M, k] float32, ids [M, k] long, lse [M] float32). Launches 2 kernels, plus one merge pass per
    factor of merge_block / k_pad by which the first stage's lists exceed it (none by default up to k = 128 at
    V = 151936; one for k = 512 with "sort"). Reads no value on the host (graph-capturable).
    """
    if triton is None:
        raise ConfigError("topk_logsumexp needs Triton; install it or build trees with fast_topk=False")
    if logits.dim() != 2:
        raise ShapeError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ShapeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ConfigError(f"k must be an int in [1, vocab = {vocab}], got {k!r}")
    if vocab > MAX_VOCAB:
        raise ShapeError(f"vocab {vocab} is too large: token ids must stay below 2**30")
    k_pad = _next_pow2(k)
    if strategy is None:
        strategy = "running" if k_pad <= tuning.RUNNING_MAX_K else "sort"
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)} (or None), got {strategy!r}")
    running = strategy == "running"
    if chunk is None:
        chunk = max(k_pad, min(tuning.RUNNING_CHUNK if running else tuning.DEFAULT_CHUNK, _next_pow2(vocab)))
    if not _is_pow2(chunk) or not k_pad <= chunk <= 65536:
        raise ConfigError(f"chunk must be a power of two >= {k_pad} (k rounded up to a power of two) and <= 65536, "
                          f"got {chunk!r}")
    if not _is_pow2(merge_block) or merge_block < 2 * k_pad:
        raise ConfigError(f"merge_block must be a power of two >= {2 * k_pad} (twice k rounded up), got {merge_block!r}")
    if warps is None:
        warps = min(8, max(1, chunk // tuning.RUNNING_ENTRIES_PER_WARP)) if running else (8 if chunk >= 4096 else 4)
    if isinstance(warps, bool) or not isinstance(warps, int) or warps not in (1, 2, 4, 8, 16):
        raise ConfigError(f"warps must be 1, 2, 4, 8 or 16, got {warps!r}")
    chunks = triton.cdiv(vocab, chunk)
    if splits is not None:
        if not running:
            raise ConfigError(f"splits applies to strategy 'running' only, got splits={splits!r} with {strategy!r}")
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 65535:
            raise ConfigError(f"splits must be an int in [1, 65535] (a CUDA grid dimension), got {splits!r}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    if out is None:
        out = (
            torch.empty(rows, k, dtype=torch.float32, device=device),
            torch.empty(rows, k, dtype=torch.long, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
        )
    values, ids, lse = out
    for name, t, shape, dtype in (("values", values, (rows, k), torch.float32), ("ids", ids, (rows, k), torch.long),
                                  ("lse", lse, (rows,), torch.float32)):
        if t.shape != shape or t.dtype != dtype or t.device != device or (t.dim() == 2 and t.stride(1) != 1):
            raise ShapeError(f"out {name} must be a {dtype} tensor of shape {list(shape)} on {device} with a "
                             f"contiguous last dim, got {t.dtype} {list(t.shape)} on {t.device}")
    if rows == 0:
        return values, ids, lse

    if running:
        if splits is None:
            splits = default_splits(rows, chunks, warps, _sm_count(device))
        lists = splits
    else:
        lists = chunks
    keys = torch.empty(rows, lists, k_pad, dtype=torch.long, device=device)
    part_max = torch.empty(rows, lists, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows, lists, dtype=torch.float32, device=device)
    if running:
        _running_topk_kernel[(rows, lists)](
            logits, logits.stride(0), vocab, chunks, triton.cdiv(chunks, lists), keys, part_max, part_sum, lists,
            CHUNK=chunk, K_PAD=k_pad, enable_fp_fusion=FP_FUSION, num_warps=warps,
        )
    else:
        _chunk_topk_kernel[(rows, lists)](
            logits, logits.stride(0), vocab, keys, part_max, part_sum, lists,
            CHUNK=chunk, K_PAD=k_pad, EXTRACT=strategy == "extract", enable_fp_fusion=FP_FUSION,
            num_warps=warps,
        )
    partials = lists
    group = merge_block // k_pad
    while lists > group:  # only for large k or many splits: each pass keeps the best k of `group` lists
        merged_lists = triton.cdiv(lists, group)
        merged = torch.empty(rows, merged_lists, k_pad, dtype=torch.long, device=device)
        _merge_topk_kernel[(rows, merged_lists)](keys, lists, merged, merged_lists, GROUP=group, K_PAD=k_pad,
                                                 enable_fp_fusion=FP_FUSION, num_warps=8)
        keys, lists = merged, merged_lists
    _final_kernel[(rows,)](
        keys, lists, part_max, part_sum, partials, values, values.stride(0), ids, ids.stride(0), lse, lse.stride(0),
        k, GROUP=_next_pow2(lists), K_PAD=k_pad, CHUNKS_PAD=_next_pow2(partials),
        enable_fp_fusion=FP_FUSION, num_warps=8 if lists * k_pad >= 4096 else 4,
    )
    return values, ids, lse


if triton is not None:
    _PAD_KEY = tl.constexpr(-(2**63))  # below every real key (the smallest, a -NaN's, is above -2**63)
    LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)

    @triton.jit
    def ordered_keys(x, ids):
        """int64 keys, larger = (value larger, or equal and id smaller); x float32 (no NaN), ids int32 < 2**31.

        Public: :mod:`ddtree.speculative.tree_select` builds its prefix keys with it (the same order, one encoding)."""
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0: give both the same key bits
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits, order as signed int
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)

    @triton.jit
    def _key_values(keys):
        """The float32 values of keys made by ordered_keys (inverse of its high half)."""
        high = (keys >> 32).to(tl.int32)
        return (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _largest(keys, K_PAD: tl.constexpr, EXTRACT: tl.constexpr = False):
        """The K_PAD largest of a 1-D block of keys, descending ([K_PAD]; tl.topk needs K_PAD >= 2).

        EXTRACT: take the maximum K_PAD times instead of tl.topk's bitonic network (keys are distinct, so
        masking the maximum removes exactly one); K_PAD block reductions against a sort of the whole block,
        which is the cheaper choice for a small K_PAD over a large chunk."""
        if K_PAD == 1:
            return tl.max(tl.reshape(keys, [1, keys.numel]), 1)
        elif EXTRACT:
            rank = tl.arange(0, K_PAD)
            top = tl.full([K_PAD], _PAD_KEY, tl.int64)
            for i in tl.static_range(K_PAD):
                best = tl.max(keys, 0)
                top = tl.where(rank == i, best, top)
                keys = tl.where(keys == best, _PAD_KEY, keys)
            return top
        else:
            return tl.topk(keys, K_PAD)

    @triton.jit
    def _running_topk_kernel(
        logits_ptr, row_stride, vocab, chunks, chunks_per_split, keys_ptr, max_ptr, sum_ptr, splits,
        CHUNK: tl.constexpr, K_PAD: tl.constexpr,
    ):
        """Program (row, split): over pieces [split * chunks_per_split, +chunks_per_split) of the row (clipped to
        ``chunks``), its K_PAD largest keys (sorted desc) and its (max, sum exp(x - max)), in one pass.

        State: top [K_PAD] int64 (distinct keys; pads PAD + 1 .. PAD + K_PAD until the first piece's keys replace
        them), low = min(top), threshold = low's value (-inf before the first piece), running max m and per-lane
        sums acc [CHUNK] of exp(x - m)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        lanes = tl.arange(0, CHUNK)
        first = tl.minimum(split * chunks_per_split, chunks)  # == chunks: a split that owns no piece
        last = tl.minimum(first + chunks_per_split, chunks)

        top = _PAD_KEY + 1 + tl.arange(0, K_PAD).to(tl.int64)  # [K_PAD]
        low = tl.min(top, 0)
        threshold = tl.full([], float("-inf"), tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        acc = tl.zeros([CHUNK], tl.float32)
        # Two loads in flight per program: pieces c + 1 and c + 2 are on their way while piece c is processed.
        ids = first * CHUNK + lanes
        x_next = tl.load(row_ptr + ids, mask=ids < vocab, other=float("-inf"))
        x_after = tl.load(row_ptr + ids + CHUNK, mask=masked_if(first + 1 < last, ids + CHUNK < vocab), other=float("-inf"))
        for c in range(first, last):
            ids = c * CHUNK + lanes  # [CHUNK] int32 token ids
            x = x_next.to(tl.float32)  # -inf past the vocabulary
            x_next = x_after
            x_after = tl.load(row_ptr + ids + 2 * CHUNK, mask=masked_if(c + 2 < last, ids + 2 * CHUNK < vocab),
                              other=float("-inf"))
            piece_max = tl.max(x, 0)
            m_new = tl.maximum(m, piece_max)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new) * LOG2E  # all -inf so far: exp(-inf - 0) adds 0
            acc = acc * tl.exp2(m * LOG2E - shift) + tl.exp2(x * LOG2E - shift)  # one FMA + ex2 per element
            m = m_new
            if piece_max >= threshold:  # a key of this piece may beat min(top); else nothing here can
                # Lanes past the vocabulary hold -inf with ids >= vocab: their keys sort below every token's, so
                # (k <= vocab) they may fill a split's list but never reach the row's top k. No mask needed.
                keys = ordered_keys(x, ids)
                best = tl.max(keys, 0)
                while best > low:  # at most K_PAD times: the piece's K_PAD largest would fill the list
                    top = tl.where(top == low, best, top)
                    low = tl.min(top, 0)
                    keys = tl.where(keys == best, _PAD_KEY, keys)
                    best = tl.max(keys, 0)
                threshold = _key_values(low)  # a real key's: a piece has CHUNK >= K_PAD lanes, so no pad is left

        slot = row.to(tl.int64) * splits + split
        tl.store(keys_ptr + slot * K_PAD + tl.arange(0, K_PAD), _largest(top, K_PAD))
        tl.store(max_ptr + slot, m)
        tl.store(sum_ptr + slot, tl.sum(acc, 0))

    @triton.jit
    def _chunk_topk_kernel(
        logits_ptr, row_stride, vocab, keys_ptr, max_ptr, sum_ptr, chunks,
        CHUNK: tl.constexpr, K_PAD: tl.constexpr, EXTRACT: tl.constexpr,
    ):
        """Program (row, chunk): the chunk's K_PAD largest keys (sorted desc) and its (max, sum exp(x - max))."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        ids = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = ids < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + ids, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        keys = tl.where(inside, ordered_keys(x, ids), _PAD_KEY)
        top = _largest(keys, K_PAD, EXTRACT)  # [K_PAD], descending
        slot = row.to(tl.int64) * chunks + chunk
        tl.store(keys_ptr + slot * K_PAD + tl.arange(0, K_PAD), top)
        m = tl.max(x, 0)
        shift = tl.where(m == float("-inf"), 0.0, m)  # all -inf: x - m would be NaN; exp(-inf - 0) sums to 0
        tl.store(max_ptr + slot, m)
        tl.store(sum_ptr + slot, tl.sum(tl.exp(x - shift), 0))

    @triton.jit
    def _merge_topk_kernel(in_ptr, in_lists, out_ptr, out_lists, GROUP: tl.constexpr, K_PAD: tl.constexpr):
        """Program (row, part): the K_PAD largest keys of lists part * GROUP .. part * GROUP + GROUP - 1."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        lists = part * GROUP + tl.arange(0, GROUP)
        offsets = (row.to(tl.int64) * in_lists + lists)[:, None] * K_PAD + tl.arange(0, K_PAD)[None, :]
        keys = tl.load(in_ptr + offsets, mask=(lists < in_lists)[:, None], other=_PAD_KEY)  # [GROUP, K_PAD]
        top = _largest(tl.reshape(keys, [GROUP * K_PAD]), K_PAD)
        tl.store(out_ptr + (row.to(tl.int64) * out_lists + part) * K_PAD + tl.arange(0, K_PAD), top)

    @triton.jit
    def _final_kernel(
        in_ptr, in_lists, max_ptr, sum_ptr, partials, values_ptr, values_stride, ids_ptr, ids_stride, lse_ptr,
        lse_stride, k, GROUP: tl.constexpr, K_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr,
    ):
        """Program row: merge the remaining lists, decode the first k keys, combine the logsumexp partials."""
        row = tl.program_id(0)
        lists = tl.arange(0, GROUP)
        offsets = (row.to(tl.int64) * in_lists + lists)[:, None] * K_PAD + tl.arange(0, K_PAD)[None, :]
        keys = tl.load(in_ptr + offsets, mask=(lists < in_lists)[:, None], other=_PAD_KEY)  # [GROUP, K_PAD]
        if GROUP == 1:
            top = tl.reshape(keys, [K_PAD])  # one list: already sorted
        else:
            top = _largest(tl.reshape(keys, [GROUP * K_PAD]), K_PAD)
        value = _key_values(top)
        token = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        rank = tl.arange(0, K_PAD)
        tl.store(values_ptr + row.to(tl.int64) * values_stride + rank, value, mask=rank < k)
        tl.store(ids_ptr + row.to(tl.int64) * ids_stride + rank, token, mask=rank < k)

        c = tl.arange(0, CHUNKS_PAD)
        part_max = tl.load(max_ptr + row.to(tl.int64) * partials + c, mask=c < partials, other=float("-inf"))
        part_sum = tl.load(sum_ptr + row.to(tl.int64) * partials + c, mask=c < partials, other=0.0)
        m = tl.max(part_max, 0)
        empty = m == float("-inf")  # no finite logit in the row
        total = tl.sum(part_sum * tl.exp(part_max - tl.where(empty, 0.0, m)), 0)  # all -inf partials add 0 * 0
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
        tl.store(lse_ptr + row.to(tl.int64) * lse_stride, lse)
