"""Per-row top-k tokens and log-normaliser of a logits matrix in one read of the row (a Triton kernel).

Why: tree building needs, for every draft depth, the K' most likely tokens and log q = logit - logsumexp(logits).
With torch that is a multi-pass radix ``topk``, a separate float32 ``logsumexp`` and, for bf16 logits, a float copy:
three passes over [R * L, V] whose cost grows with R. Here the row is split into chunks; one program per
(row, chunk) reads its chunk once and keeps the chunk's top-k and its partial (max, sum of exp); a merge stage then
combines the per-chunk candidates (k per chunk, a few thousand per row) and the partials.

Order and ties
--------------
Every element becomes one distinct int64 key, ``ordered_bits(value) << 32 | (2**31 - 1 - token_id)``, where
``ordered_bits`` maps a float32 to an int32 with the same order. A larger key is a larger value, or an equal value
and a smaller token id, so selecting the k largest keys and sorting them descending gives the canonical candidate
order of :mod:`ddtree.spec.tree` (log-prob desc, token id asc) with no re-ranking sort; when more than k tokens tie
at the k-th value the lowest ids enter. -0.0 is read as +0.0 (the two compare equal). Logits must not hold NaN or
+inf (a drafter never emits them); -inf entries and all -inf rows are fine (their logsumexp is -inf).

Selection inside a program is ``tl.topk`` (a bitonic top-k: sort blocks of k, then halve with max and re-merge),
which costs about log2(k)^2 / 2 compare-exchange stages per element: small k is cheapest.

The logsumexp is float32 even for half-precision input, as ``torch.logsumexp(x.float())``; the two are not bit
equal (different summation order), they agree to a few float32 ulps.

When it runs: ``build_trees(..., fast_topk=True)`` (the caller's choice) uses it for widths up to
:data:`FAST_MAX_K` when :func:`available` - :func:`ddtree.triton_runtime.can_run` (a CUDA tensor; a CPU tensor
only under Triton's interpreter inside ``triton_runtime.cpu_interpreter()``, which tests use) and a supported dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.errors import ConfigError
from ddtree.triton_runtime import can_run, tl, triton

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# build_trees uses the kernel only up to this many candidates per depth. Measured on the H200 (CUDA graphs, V = 151936,
# L = 15, docs/benchmarks/gpu/run4_tree_ops.md): at width 8 and 16 it beats torch.topk + logsumexp at R = 1 and 64
# (R = 64, B = 16: 2.72 vs 3.07 ms); at width 512 each chunk's sort dominates and it loses (R = 64: 10.8 vs 3.6 ms).
FAST_MAX_K = 16
EXTRACT_MAX_K = 16  # chunk top-k by repeated maximum up to this k (see _largest)
DEFAULT_CHUNK = 4096  # vocabulary entries per first-stage program: 38 programs per row at V = 151936
MERGE_BLOCK = 8192  # candidate keys one merge program selects from (bounds its registers)


def available(t: Tensor) -> bool:
    """Whether :func:`topk_logsumexp` can run on ``t``: a Triton kernel can run on its device
    (:func:`ddtree.triton_runtime.can_run`) and its dtype is one the kernel reads."""
    return t.dtype in SUPPORTED_DTYPES and can_run(t)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def topk_logsumexp(
    logits: Tensor,
    k: int,
    *,
    chunk: int | None = None,
    merge_block: int = MERGE_BLOCK,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
    extract: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` largest logits of every row (value desc, token id asc) and every row's logsumexp.

    logits: [M, V] float32, bfloat16 or float16 (rows need not be contiguous to each other; the vocab dim is made
        contiguous if it is not). k: 1 <= k <= V. chunk: vocabulary entries per first-stage program (a power of
        two >= k rounded up to a power of two; default 4096 or the whole row when smaller) - a tuning and test knob.
    merge_block: most candidate keys one merge program selects from (a power of two >= 2 * that rounded k); when
        the chunks hold more, extra merge passes run first - a tuning and test knob.
    out: optional preallocated (values [M, k] float32, ids [M, k] long, lse [M] float32; the [M, k] ones with a
        contiguous last dim), written in full and nothing else.
    extract: how a chunk's top keys are found: True = K_PAD rounds of "take the maximum", False = tl.topk's
        sorting network; None = extraction up to ``EXTRACT_MAX_K``. A tuning and test knob (same results).

    Returns (values [M, k] float32, ids [M, k] long, lse [M] float32). Launches 2 kernels, plus one merge pass per
    factor of merge_block / k_pad by which the chunk count exceeds it (none for k <= 128 at V = 151936, one for
    k = 512). Reads no value on the host (graph-capturable).
    """
    if triton is None:
        raise ConfigError("topk_logsumexp needs Triton; install it or build trees with fast_topk=False")
    if logits.dim() != 2:
        raise ConfigError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ConfigError(f"k must be an int in [1, vocab = {vocab}], got {k!r}")
    if vocab >= 2**31:
        raise ConfigError(f"vocab {vocab} is too large: token ids must fit in 31 bits")
    k_pad = _next_pow2(k)
    if chunk is None:
        chunk = max(k_pad, min(DEFAULT_CHUNK, _next_pow2(vocab)))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < k_pad or chunk & (chunk - 1):
        raise ConfigError(f"chunk must be a power of two >= {k_pad} (k rounded up to a power of two), got {chunk!r}")
    if isinstance(merge_block, bool) or not isinstance(merge_block, int) or merge_block < 2 * k_pad or (
        merge_block & (merge_block - 1)
    ):
        raise ConfigError(f"merge_block must be a power of two >= {2 * k_pad} (twice k rounded up), got {merge_block!r}")
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
            raise ConfigError(f"out {name} must be a {dtype} tensor of shape {list(shape)} on {device} with a "
                              f"contiguous last dim, got {t.dtype} {list(t.shape)} on {t.device}")
    if rows == 0:
        return values, ids, lse

    chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty(rows, chunks, k_pad, dtype=torch.long, device=device)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    _chunk_topk_kernel[(rows, chunks)](
        logits, logits.stride(0), vocab, keys, part_max, part_sum, chunks,
        CHUNK=chunk, K_PAD=k_pad, EXTRACT=k_pad <= EXTRACT_MAX_K if extract is None else extract,
        num_warps=8 if chunk >= 4096 else 4,
    )
    lists = chunks
    group = merge_block // k_pad
    while lists > group:  # only for large k: each pass keeps the best k of `group` lists
        merged_lists = triton.cdiv(lists, group)
        merged = torch.empty(rows, merged_lists, k_pad, dtype=torch.long, device=device)
        _merge_topk_kernel[(rows, merged_lists)](keys, lists, merged, merged_lists, GROUP=group, K_PAD=k_pad,
                                                 num_warps=8)
        keys, lists = merged, merged_lists
    _final_kernel[(rows,)](
        keys, lists, part_max, part_sum, chunks, values, values.stride(0), ids, ids.stride(0), lse, lse.stride(0), k,
        GROUP=_next_pow2(lists), K_PAD=k_pad, CHUNKS_PAD=_next_pow2(chunks), num_warps=8 if lists * k_pad >= 4096 else 4,
    )
    return values, ids, lse


if triton is not None:
    _PAD_KEY = tl.constexpr(-(2**63))  # below every real key (the smallest, a -NaN's, is above -2**63)

    @triton.jit
    def _ordered_keys(x, ids):
        """int64 keys, larger = (value larger, or equal and id smaller); x float32 (no NaN), ids int32 < 2**31."""
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0: give both the same key bits
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits, order as signed int
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)

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
        keys = tl.where(inside, _ordered_keys(x, ids), _PAD_KEY)
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
        in_ptr, in_lists, max_ptr, sum_ptr, chunks, values_ptr, values_stride, ids_ptr, ids_stride, lse_ptr,
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
        high = (top >> 32).to(tl.int32)
        value = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        token = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        rank = tl.arange(0, K_PAD)
        tl.store(values_ptr + row.to(tl.int64) * values_stride + rank, value, mask=rank < k)
        tl.store(ids_ptr + row.to(tl.int64) * ids_stride + rank, token, mask=rank < k)

        c = tl.arange(0, CHUNKS_PAD)
        part_max = tl.load(max_ptr + row.to(tl.int64) * chunks + c, mask=c < chunks, other=float("-inf"))
        part_sum = tl.load(sum_ptr + row.to(tl.int64) * chunks + c, mask=c < chunks, other=0.0)
        m = tl.max(part_max, 0)
        empty = m == float("-inf")  # no finite logit in the row
        total = tl.sum(part_sum * tl.exp(part_max - tl.where(empty, 0.0, m)), 0)  # all -inf chunks add 0 * 0
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
        tl.store(lse_ptr + row.to(tl.int64) * lse_stride, lse)
