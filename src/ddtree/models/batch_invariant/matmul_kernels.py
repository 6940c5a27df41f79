"""Exact mode's matmul kernels (Triton): the programs :func:`ddtree.models.batch_invariant.matmul.linear` launches.

Each output element is summed in one fixed order: its K segments, each from zero in ascending K order, added in
ascending order, the bias last (the package docstring). Three kernels: split programs writing fp32 partials, fused
programs walking the segments themselves (through pointers, :func:`_matmul_kernel`, or Hopper's tensor descriptors,
:func:`_matmul_tma_kernel`), and the in-order sum of the partials (:func:`_split_sum_kernel`). :func:`_dot` is the
one dot both exact kernels use (attention's too), so the interpreter's emulation is the same everywhere.
"""

from __future__ import annotations

from ddtree.triton_runtime import tl, triton

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b in fp32. EMULATE (Triton's interpreter only): an fp32 broadcast product summed over K with
        ``tl.sum``, because the interpreter's ``tl.dot`` is numpy's BLAS matmul, whose result for a row changes with
        the row's place in the tile (and whose bf16 dot multiplies raw bit patterns). On a GPU the tensor-core dot
        runs; its rows are independent of each other for one instruction K-step (tile shapes do not enter: the
        GPU test compares them)."""
        if EMULATE:
            out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        else:
            out = tl.dot(a, b, acc, input_precision=PRECISION)
        return out

    @triton.jit
    def _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k0, BLOCK_K: tl.constexpr,
                EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """acc + x[rm, k0 : k0 + BLOCK_K] @ w[rn, k0 : k0 + BLOCK_K]^T (K past the end loads 0)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return _dot(x, tl.trans(w), acc, EMULATE, PRECISION)

    @triton.jit
    def _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo, k_hi, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One K segment's fp32 sum from zero, its K blocks in ascending order: [BLOCK_M, BLOCK_N]."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc = _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k0, BLOCK_K, EMULATE,
                          PRECISION)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLITS: tl.constexpr, FUSED: tl.constexpr, FLAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """FUSED (grid: row tiles x column tiles): total = ((seg_0 + seg_1) + ...) + seg_{S-1}, then the bias, and
        store. Otherwise (grid x SPLITS): seg_{pid} -> part[split, m, n] in fp32 (:func:`_split_sum_kernel` adds
        them in the same order), or with one split the bias and the store directly."""
        pid_m = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        if FUSED or SPLITS == 1:
            if FLAT and SPLITS > 1:
                # seg_s summed from zero in ascending K order, then total = seg_0 (not 0 + seg_0: -0 stays -0) and
                # total + seg_s at the end of each later segment: the bits of the loop per segment below
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                per_split = k_per_split // BLOCK_K
                for kb in range(0, SPLITS * per_split):
                    acc = _k_step(acc, x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, kb * BLOCK_K,
                                  BLOCK_K, EMULATE, PRECISION)
                    if (kb + 1) % per_split == 0:
                        total = tl.where(kb + 1 == per_split, acc, total + acc)
                        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            else:
                total = _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, 0,
                                 tl.minimum(k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE, PRECISION)
                for s in range(1, SPLITS):  # a loop, not unrolled: the inner K loop stays one pipelined loop
                    k_lo = s * k_per_split
                    total = total + _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo,
                                             tl.minimum(k_lo + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE,
                                             PRECISION)
            if HAS_BIAS:
                total = total + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        else:
            pid_s = tl.program_id(2).to(tl.int64)
            k_lo = pid_s * k_per_split
            acc = _segment(x_ptr, w_ptr, rm, rn, m_ok, n_ok, K, stride_xm, stride_wn, k_lo,
                           tl.minimum(k_lo + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, EMULATE, PRECISION)
            part = part_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :]
            tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _matmul_tma_kernel(x_desc, w_desc, out_desc, b_ptr, part_ptr, M, N, k_per_split, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, FUSED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """:func:`_matmul_kernel`'s sums with its tiles loaded by tensor descriptors (rows and columns past the end
        load 0 and are not stored). FUSED (grid: row tiles x column tiles; the flat loop): seg_s from zero in
        ascending K order, total = seg_0, then total + seg_s at each later segment's end, the bias last. Otherwise
        (grid x SPLITS): seg_{pid} -> part[split, m, n] in fp32 for :func:`_split_sum_kernel`."""
        off_m = tl.program_id(0) * BLOCK_M
        off_n = tl.program_id(1) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        per_split = k_per_split // BLOCK_K
        if FUSED:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, SPLITS * per_split):
                x = x_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                acc = _dot(x, tl.trans(w), acc, EMULATE, PRECISION)
                if (kb + 1) % per_split == 0:
                    total = tl.where(kb + 1 == per_split, acc, total + acc)
                    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if HAS_BIAS:
                rn = off_n + tl.arange(0, BLOCK_N)
                total = total + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            out_desc.store([off_m, off_n], total.to(out_desc.dtype))
        else:
            pid_s = tl.program_id(2)
            for kb in range(pid_s * per_split, (pid_s + 1) * per_split):
                x = x_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                acc = _dot(x, tl.trans(w), acc, EMULATE, PRECISION)
            rm = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            part = part_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :]
            tl.store(part, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """out[m, n] = ((part[0] + part[1]) + ...) + bias, splits in ascending order, one element per lane."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mn = M.to(tl.int64) * N  # one split's elements (int64: SPLITS x M x N passes 2^31 for an LM head)
        ok = idx < mn
        m = idx // N
        n = idx % N
        total = tl.load(part_ptr + idx, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            total = total + tl.load(part_ptr + s * mn + idx, mask=ok, other=0.0)
        if HAS_BIAS:
            total = total + tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=ok)
