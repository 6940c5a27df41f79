"""Exact mode's attention kernels (Triton): the programs :func:`ddtree.models.batch_invariant.attention_launch.attention`
launches.

Keys walked in position order in tiles of ``ATTN_BLOCK_N`` and splits of ``ATTN_SPLIT_KEYS`` positions, the splits'
states merged in ascending order (the package docstring). :func:`_attention_kernel` runs either launch: a program
per split storing fp32 partials, which :func:`_attention_combine_kernel` merges, or fused programs that merge their
own splits (:func:`_fused_program`); a tree's tiles above the prefix run a chunk of queries on one path at a time
(:func:`_tail_chunk`, :func:`_chunk_splits`).
"""

from __future__ import annotations

from ddtree.triton_runtime import tl, triton

if triton is not None:
    from ddtree.models.batch_invariant.matmul_kernels import _dot

    @triton.jit
    def _key_index(j, start, pos_q, anc_row_ptr):
        """(cache index [BLOCK_N] int64, visible [BLOCK_N]) of the keys one tree query reads at positions j: cache
        index j below start, the ancestor's slot above it; not visible past pos_q or where it has no ancestor at that
        depth."""
        above = j >= start
        anc = tl.load(anc_row_ptr + (j - start), mask=above & (j <= pos_q), other=-1)
        idx = tl.where(above, start + anc, j).to(tl.int64)
        ok = (j <= pos_q) & ((~above) | (anc >= 0))
        return idx, ok

    @triton.jit
    def _shared_tile(base, stride_p, offs_d, j, max_pos):
        """The K or V tile [BLOCK_N, D] at positions j [BLOCK_N] that every query of a program reads alike (contiguous
        in the cache: prefix tiles, every tile of a chain or prompt chunk), loaded up to ``max_pos``, 0 past it."""
        return tl.load(base + j[:, None].to(tl.int64) * stride_p + offs_d[None, :], mask=(j <= max_pos)[:, None],
                       other=0.0)

    @triton.jit
    def _tile_update(q, k, v, vis, m_i, l_i, acc, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile of the online softmax for rows q [M, D] over k, v [BLOCK_N, D] (visible [M, BLOCK_N]) ->
        (m, l, acc): the arithmetic every tile of every launch does, so that a row's bits follow from its own keys
        (a tensor-core dot's row depends on that row and the tile only, whatever M)."""
        scores = _dot(q, tl.trans(k.to(q.dtype)), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), EMULATE,
                      PRECISION)
        p, alpha, l_i, m_new = _softmax_step(scores, vis, m_i, l_i, ones, scale_log2, EMULATE, PRECISION)
        return m_new, l_i, _dot(p, v.to(q.dtype), acc * alpha[:, None], EMULATE, PRECISION)

    @triton.jit
    def _softmax_step(scores, vis, m_i, l_i, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile of the online softmax, the same code for the shared and the per-query tiles (their bits must
        agree): -> (p, alpha, l, m) with p the tile's unnormalised probabilities in the dot's dtype, alpha the
        rescale of what came before, l [BLOCK_M, ATTN_SUM_COLS] the running sum (every column alike) and m the
        running max (masked keys: exp2(-inf) = 0, -inf - -inf guarded).

        The row sum is a dot with a ones matrix, not ``tl.sum(p, 1)``: a reduction over the tile follows the
        register layout the dot left it in, and that layout follows the program's row count (64-row programs gave
        chain rows 1 ulp off a 32-row program's, H200, 2026-12-01), while a tensor-core dot's row depends on that
        row and the tile only (measured on the H200 for 32- and 64-row programs: G = 4, D = 128, bf16, Triton 3.6).
        It sums the same bf16 weights P @ V uses; max is exact in any order."""
        qk = tl.where(vis, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None]).to(ones.dtype)
        return p, alpha, _dot(p, ones, l_i * alpha[:, None], EMULATE, PRECISION), m_new

    @triton.jit
    def _split_state(q, k_base, v_base, row_ok, pos_row, max_pos, split, stride_kp, stride_vp, scale_log2, offs_d,
                     offs_n, ones, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, EMULATE: tl.constexpr,
                     PRECISION: tl.constexpr):
        """The online softmax of a program's rows over the key tiles of one split, from zero, in ascending position
        order -> (m [BLOCK_M] running max, l [BLOCK_M] sum, acc [BLOCK_M, HEAD_DIM] unnormalised), fp32; the split
        launch stores it per split (the fused launch, :func:`_fused_program`, does the same arithmetic in one loop).

        Only for splits whose keys every query of the program reads alike: all of a chain's or a prompt chunk's, a
        tree's wholly below ``start // BLOCK_N``. A tree's splits from there up run one chunk of queries on one path
        per program (:func:`_chunk_splits`), so that its chunks run side by side and not one after another."""
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        tile_lo = split * TILES_PER_SPLIT
        for tile in range(tile_lo, tl.minimum(tile_lo + TILES_PER_SPLIT, max_pos // BLOCK_N + 1)):
            j = tile * BLOCK_N + offs_n
            k = _shared_tile(k_base, stride_kp, offs_d, j, max_pos)
            v = _shared_tile(v_base, stride_vp, offs_d, j, max_pos)
            m_i, l_i, acc = _tile_update(q, k, v, (j[None, :] <= pos_row[:, None]) & row_ok[:, None], m_i, l_i, acc,
                                         ones, scale_log2, EMULATE, PRECISION)
        return m_i, tl.max(l_i, 1), acc  # l's columns are equal

    @triton.jit
    def _chunk_lanes(q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d,
                     TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr):
        """The rows of one tail chunk (:func:`tail_chunks`, ``chunk_ptr`` at its lead): TAIL_ROWS lanes, each member's
        G heads, padded -> (lane_ok, member t [TAIL_ROWS], head, its position, q [TAIL_ROWS, D], the lead, its
        position)."""
        lane = tl.arange(0, TAIL_ROWS)
        slot = lane // G
        member = tl.load(chunk_ptr + 1 + slot, mask=slot < CHUNK, other=-1)
        lane_ok = (slot < CHUNK) & (member >= 0)
        t_l = tl.where(lane_ok, member, 0)
        head_l = kv * G + lane % G
        lead = tl.load(chunk_ptr)
        pos_lead = tl.load(pos_ptr + r * T + lead)
        pos_l = tl.load(pos_ptr + r * T + t_l, mask=lane_ok, other=-1)
        q_g = tl.load(q_ptr + r * stride_qr + head_l[:, None] * stride_qh + t_l[:, None] * stride_qt + offs_d[None, :],
                      mask=lane_ok[:, None], other=0.0)
        return lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead

    @triton.jit
    def _chunk_tile(q_g, k_base, v_base, anc_lead, j, start, pos_lead, pos_l, lane_ok, m_g, l_g, acc_g, stride_kp,
                    stride_vp, offs_d, ones, scale_log2, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One key tile (positions j) of a tail chunk on its members' rows: the lead's keys (:func:`_key_index`: the
        shared ones below start, its ancestors above) gathered once, each member masked past its own position."""
        idx, seen = _key_index(j, start, pos_lead, anc_lead)
        k = tl.load(k_base + idx[:, None] * stride_kp + offs_d[None, :], mask=seen[:, None], other=0.0)
        v = tl.load(v_base + idx[:, None] * stride_vp + offs_d[None, :], mask=seen[:, None], other=0.0)
        vis = seen[None, :] & (j[None, :] <= pos_l[:, None]) & lane_ok[:, None]
        return _tile_update(q_g, k, v, vis, m_g, l_g, acc_g, ones, scale_log2, EMULATE, PRECISION)

    @triton.jit
    def _chunk_splits(q_ptr, k_base, v_base, anc_base, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, chunk_ptr, r, kv,
                      start, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt, T, G, num_kv, num_splits,
                      scale_log2, offs_d, offs_n, ones, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr,
                      CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """The split launch's tree tail: one chunk of queries on one path (:func:`tail_chunks`) on TAIL_ROWS rows, each
        split from the one holding ``start // BLOCK_N`` to its lead's last, from zero, stored as its members' partials
        (members whose position reaches the split). Its tiles below ``start`` load the shared keys, those above it the
        lead's ancestors (:func:`_key_index`), which hold every member's keys up to its own position (the rest are
        masked, exact no-ops): the tile arithmetic of :func:`_split_state` and of the fused launch's
        :func:`_tail_chunk`, so the same bits.

        Why a program per chunk: at one request a tree's split launch has few programs (a 64-node tree: 8 query
        tiles x 8 KV heads), and a query tile's chunks one after another made the split that holds the tail the
        launch's longest program (each chunk a gathered K and V tile and two dots of the whole tile's rows); here
        they run side by side, each re-reading the split's few shared tiles below start."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead = _chunk_lanes(
            q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d, TAIL_ROWS, CHUNK)
        anc_lead = anc_base + lead * T
        last_tile = pos_lead // BLOCK_N
        # up to the lead's last split, never past the partials' (kv_len > every position is the contract; a breach
        # must not write into the next head's partials)
        for s in range((start // BLOCK_N) // TPS, tl.minimum(last_tile // TPS + 1, num_splits)):
            m_g = tl.full([TAIL_ROWS], float("-inf"), dtype=tl.float32)
            l_g = tl.zeros([TAIL_ROWS, SUM_COLS], dtype=tl.float32)
            acc_g = tl.zeros([TAIL_ROWS, HEAD_DIM], dtype=tl.float32)
            for tile in range(s * TPS, tl.minimum(s * TPS + TPS, last_tile + 1)):
                m_g, l_g, acc_g = _chunk_tile(q_g, k_base, v_base, anc_lead, tile * BLOCK_N + offs_n, start, pos_lead,
                                              pos_l, lane_ok, m_g, l_g, acc_g, stride_kp, stride_vp, offs_d, ones,
                                              scale_log2, EMULATE, PRECISION)
            part = ((r * T + t_l) * (num_kv * G) + head_l) * num_splits + s
            keep = lane_ok & (s * (TPS * BLOCK_N) <= pos_l)
            tl.store(part_m_ptr + part, m_g, mask=keep)
            tl.store(part_l_ptr + part, tl.max(l_g, 1), mask=keep)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc_g, mask=keep[:, None])

    @triton.jit
    def _merge_weights(m_run, m_s):
        """The weights of one merge step of the splits, in ascending split order: -> (m, w_run, w_s) with
        m = max(m_run, m_s) and w = 2^(m_x - m); the caller forms ``fma(x_run, w_run, x_s * w_s)`` for l and acc
        (explicit fma: the fused and the combine kernel must round alike, and a compiler's own contraction need not
        be the same in both). An empty split (m_s = -inf: no visible key) merges as an exact no-op; -inf - -inf is
        guarded."""
        m = tl.maximum(m_run, m_s)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        return m, tl.exp2(m_run - m_use), tl.exp2(m_s - m_use)

    @triton.jit
    def _merge_split(m_run, l_run, acc_run, m_s, l_s, acc_s, take):
        """The running state after merging one split's (m_s, l_s [rows], acc_s [rows, D]) into it, in rows ``take``
        (:func:`_merge_weights`; the combine kernel's arithmetic)."""
        m_new, w_run, w_s = _merge_weights(m_run, m_s)
        l_run = tl.where(take, tl.fma(l_run, w_run, l_s * w_s), l_run)
        acc_run = tl.where(take[:, None], tl.fma(acc_run, w_run[:, None], acc_s * w_s[:, None]), acc_run)
        return tl.where(take, m_new, m_run), l_run, acc_run

    @triton.jit
    def _tail_chunk(q_ptr, k_base, v_base, anc_base, pos_ptr, out_ptr, state_ptr, chunk_ptr, r, kv, pid_q, prog, start,
                    shared_hi, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt, stride_or, stride_oh, stride_ot,
                    T, G, scale_log2, offs_d, offs_n, ones, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                    QT: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr,
                    TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """One tail chunk (:func:`tail_chunks`: up to CHUNK queries on one path, ``chunk_ptr`` at its lead) on
        TAIL_ROWS rows (each member's G heads, padded): the lead's tail tiles (from ``shared_hi``) gathered once,
        each member's rows resumed from its state in program ``prog``'s part of ``state_ptr``
        (:func:`_fused_program`) and masked past its own position, its last split merged, its output stored.

        A member's rows take the bits they would alone: its visible keys are the lead's at those positions, keys past
        its position are exact no-ops (p = 0), and it merges each split at the split edge after it (or at the end),
        as a query alone does at its end; nothing is merged for it after that."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        width = 2 * HEAD_DIM + 4
        lane = tl.arange(0, TAIL_ROWS)
        lane_ok, t_l, head_l, pos_l, q_g, lead, pos_lead = _chunk_lanes(
            q_ptr, pos_ptr, chunk_ptr, r, kv, T, G, stride_qr, stride_qh, stride_qt, offs_d, TAIL_ROWS, CHUNK)
        sg = state_ptr + (prog * ROWS + (t_l - pid_q * QT) * G + lane % G) * width  # ROWS: the launch's rows a program
        acc_g = tl.load(sg[:, None] + offs_d[None, :], mask=lane_ok[:, None], other=0.0)
        acc_run_g = tl.load(sg[:, None] + HEAD_DIM + offs_d[None, :], mask=lane_ok[:, None], other=0.0)
        m_g = tl.load(sg + 2 * HEAD_DIM, mask=lane_ok, other=float("-inf"))
        l_g = tl.load(sg + 2 * HEAD_DIM + 1, mask=lane_ok, other=0.0)[:, None] + tl.zeros([TAIL_ROWS, SUM_COLS],
                                                                                          dtype=tl.float32)
        m_run_g = tl.load(sg + 2 * HEAD_DIM + 2, mask=lane_ok, other=float("-inf"))
        l_run_g = tl.load(sg + 2 * HEAD_DIM + 3, mask=lane_ok, other=0.0)
        anc_lead = anc_base + lead * T
        for tile in range(shared_hi, pos_lead // BLOCK_N + 1):
            if (tile % TPS == 0) & (tile > 0):
                take = lane_ok & ((tile // TPS - 1) * (TPS * BLOCK_N) <= pos_l)
                m_run_g, l_run_g, acc_run_g = _merge_split(m_run_g, l_run_g, acc_run_g, m_g, tl.max(l_g, 1), acc_g,
                                                           take)
                m_g = tl.full([TAIL_ROWS], float("-inf"), dtype=tl.float32)
                l_g = tl.zeros([TAIL_ROWS, SUM_COLS], dtype=tl.float32)
                acc_g = tl.zeros([TAIL_ROWS, HEAD_DIM], dtype=tl.float32)
            m_g, l_g, acc_g = _chunk_tile(q_g, k_base, v_base, anc_lead, tile * BLOCK_N + offs_n, start, pos_lead,
                                          pos_l, lane_ok, m_g, l_g, acc_g, stride_kp, stride_vp, offs_d, ones,
                                          scale_log2, EMULATE, PRECISION)
        take = lane_ok & ((pos_l // BLOCK_N) // TPS == (pos_lead // BLOCK_N) // TPS)  # else merged at its edge
        m_run_g, l_run_g, acc_run_g = _merge_split(m_run_g, l_run_g, acc_run_g, m_g, tl.max(l_g, 1), acc_g, take)
        out = acc_run_g / tl.where(l_run_g > 0.0, l_run_g, 1.0)[:, None]
        tl.store(out_ptr + r * stride_or + head_l[:, None] * stride_oh + t_l[:, None] * stride_ot + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=lane_ok[:, None])

    @triton.jit
    def _split_edge(tile, row_ok, pos_row, m_run, l_run, acc_run, m_i, l_i, acc, BLOCK_N: tl.constexpr,
                    TPS: tl.constexpr):
        """The fused loop at split edge ``tile`` (its first tile, > 0): split ``tile // TPS - 1``'s state merged into
        the running one in the rows whose position reaches it (:func:`_merge_split`), and restarted from zero ->
        (m_run, l_run, acc_run, m_i, l_i, acc)."""
        take = row_ok & ((tile // TPS - 1) * (TPS * BLOCK_N) <= pos_row)
        m_run, l_run, acc_run = _merge_split(m_run, l_run, acc_run, m_i, tl.max(l_i, 1), acc, take)
        return (m_run, l_run, acc_run, tl.full(m_i.shape, float("-inf"), dtype=tl.float32), tl.zeros_like(l_i),
                tl.zeros_like(acc))

    @triton.jit
    def _store_output(out_ptr, r, head, t, row_ok, pos_row, n_tiles, m_run, l_run, acc_run, m_i, l_i, acc,
                      stride_or, stride_oh, stride_ot, offs_d, BLOCK_N: tl.constexpr, TPS: tl.constexpr):
        """A fused program's rows without a tail: the last split merged (in the rows whose position reaches it),
        then out = acc / l stored."""
        take = row_ok & (((n_tiles - 1) // TPS) * (TPS * BLOCK_N) <= pos_row)
        m_run, l_run, acc_run = _merge_split(m_run, l_run, acc_run, m_i, tl.max(l_i, 1), acc, take)
        out = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
        tl.store(out_ptr + r * stride_or + head[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _store_state(st, acc, acc_run, m_i, l_i, m_run, l_run, HEAD_DIM: tl.constexpr):
        """Rows' state at ``st`` [rows] (row starts, fp32, width 2 x HEAD_DIM + 4): acc, acc_run, m, l, m_run,
        l_run, for the tail chunks to resume (:func:`_tail_chunk`)."""
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(st[:, None] + offs_d[None, :], acc)
        tl.store(st[:, None] + HEAD_DIM + offs_d[None, :], acc_run)
        tl.store(st + 2 * HEAD_DIM, m_i)
        tl.store(st + 2 * HEAD_DIM + 1, tl.max(l_i, 1))
        tl.store(st + 2 * HEAD_DIM + 2, m_run)
        tl.store(st + 2 * HEAD_DIM + 3, l_run)

    @triton.jit
    def _fused_program(q, k_base, v_base, anc_base, tail_base, pos_ptr, out_ptr, state_ptr, r, t, row_ok, head,
                       pos_row, max_pos, all_chain, start, kv, pid_q, pid_rk, stride_kp, stride_vp, stride_qr,
                       stride_qh, stride_qt, q_ptr, stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d, offs_n,
                       ones, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, QT: tl.constexpr,
                       BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr,
                       TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
        """The fused launch's program: every split of its rows in one loop over the key tiles, merged in ascending
        order, and the output stored. The bits of the split launch (:func:`_split_state` per split, then the
        combine kernel): the same tile arithmetic (:func:`_tile_update`) from the same zero state at each split's
        first tile, the same merge (:func:`_merge_split`) in the rows whose position reaches the split.

        One loop, not a loop per split: the loads stay software-pipelined across split edges (a loop per split
        drains the pipeline every ATTN_SPLIT_KEYS / ATTN_BLOCK_N tiles). Tiles the program's queries read alike (all
        of a chain's or a prompt chunk's; below ``start // BLOCK_N`` in a tree) run on all BLOCK_M rows at once. A
        tree's tiles above that, where each query reads its own ancestors, run one chunk of queries on one path at a
        time (:func:`tail_chunks`, :func:`_tail_chunk`) on TAIL_ROWS rows (its members' G heads, padded): the program
        stores its rows' state to ``state_ptr`` (fp32, exact; ROWS a program, the launch's rows, which a small last
        tile's BLOCK_M is below) and each chunk resumes its members' rows from there, so a tail tile costs one gather
        and a dot of TAIL_ROWS rows per chunk, not one of BLOCK_M rows per query."""
        TPS: tl.constexpr = TILES_PER_SPLIT
        n_tiles = max_pos // BLOCK_N + 1
        shared_hi = tl.where(all_chain != 0, n_tiles, tl.minimum(n_tiles, start // BLOCK_N))
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M, SUM_COLS], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for tile in range(0, shared_hi):
            if (tile % TPS == 0) & (tile > 0):  # split tile // TPS - 1 ends here: merge it, start the next from zero
                m_run, l_run, acc_run, m_i, l_i, acc = _split_edge(tile, row_ok, pos_row, m_run, l_run, acc_run, m_i,
                                                                   l_i, acc, BLOCK_N, TPS)
            j = tile * BLOCK_N + offs_n
            k = _shared_tile(k_base, stride_kp, offs_d, j, max_pos)
            v = _shared_tile(v_base, stride_vp, offs_d, j, max_pos)
            m_i, l_i, acc = _tile_update(q, k, v, (j[None, :] <= pos_row[:, None]) & row_ok[:, None], m_i, l_i, acc,
                                         ones, scale_log2, EMULATE, PRECISION)
        if shared_hi == n_tiles:  # no tail: the last split, then the output
            _store_output(out_ptr, r, head, t, row_ok, pos_row, n_tiles, m_run, l_run, acc_run, m_i, l_i, acc,
                          stride_or, stride_oh, stride_ot, offs_d, BLOCK_N, TPS)
        else:
            # state rows [ROWS, 2 * HEAD_DIM + 4] of this program: acc, acc_run, m, l, m_run, l_run
            width = 2 * HEAD_DIM + 4
            prog = (pid_rk * tl.num_programs(0) + pid_q).to(tl.int64)
            _store_state(state_ptr + (prog * ROWS + tl.arange(0, BLOCK_M)) * width, acc, acc_run, m_i, l_i, m_run,
                         l_run, HEAD_DIM)
            tl.debug_barrier()  # the rows' state is read back by other threads of this program
            for c in range(0, tl.load(tail_base)):
                _tail_chunk(q_ptr, k_base, v_base, anc_base, pos_ptr, out_ptr, state_ptr, tail_base + 1 + c * (1 + CHUNK),
                            r, kv, pid_q, prog, start, shared_hi, stride_kp, stride_vp, stride_qr, stride_qh, stride_qt,
                            stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d, offs_n, ones, HEAD_DIM, ROWS,
                            QT, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, EMULATE, PRECISION)

    @triton.jit
    def _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh, stride_qt, offs_d):
        """A query tile's rows: (q [BLOCK_M, D], position [BLOCK_M] (-1 past T), the tile's last position)."""
        q = tl.load(q_ptr + r * stride_qr + head[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos_row = tl.load(pos_ptr + r * T + t, mask=row_ok, other=-1)
        return q, pos_row, tl.max(pos_row, 0)

    @triton.jit
    def _attention_program(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
        part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
        stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, pid_s, pid_rk, T, G, num_kv,
        num_splits, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, QT: tl.constexpr,
        BLOCK_N: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr,
        CHUNK: tl.constexpr, FUSED: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One program's rows (query tile pid_q, row x KV head pid_rk; BLOCK_M of them, where the launch's programs
        have ROWS): split pid_s's state stored as partials, or (FUSED) every split up to the program's last position
        merged in ascending order and the output stored. In the split launch ``pid_s >= num_splits`` names the query
        tile's tail chunk ``pid_s - num_splits`` (:func:`_chunk_splits`; none for a tile of chains), and the tile's
        own programs store only the splits wholly below key tile ``start // BLOCK_N`` (split ``start // BLOCK_N //
        TILES_PER_SPLIT`` on are the chunks') where its queries form a tree."""
        r = (pid_rk // num_kv).to(tl.int64)
        kv = pid_rk % num_kv
        rows = tl.arange(0, BLOCK_M)
        qi = rows // G  # query within the tile (query-major folding)
        t = pid_q * QT + qi
        row_ok = (qi < QT) & (t < T)
        head = kv * G + rows % G
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + r)
        start = tl.load(start_ptr + r)
        all_chain = tl.min(tl.load(chain_ptr + r * T + t, mask=row_ok, other=1), 0)
        k_base = k_ptr + slot * stride_ks + kv * stride_kh
        v_base = v_ptr + slot * stride_vs + kv * stride_vh
        anc_base = anc_ptr + r * T * T
        tail_base = tail_ptr + (r * tl.num_programs(0) + pid_q) * (1 + QT * (1 + CHUNK))  # tail_chunks' table
        # made in fp32 and cast: Triton 3.6's interpreter has no bf16 constant (``tl.full`` in bf16 fails there)
        ones = tl.full([BLOCK_N, SUM_COLS], 1.0, dtype=tl.float32).to(q_ptr.dtype.element_ty)
        if FUSED:
            q, pos_row, max_pos = _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh,
                                                stride_qt, offs_d)
            _fused_program(q, k_base, v_base, anc_base, tail_base, pos_ptr, out_ptr, state_ptr, r, t, row_ok, head,
                           pos_row, max_pos, all_chain, start, kv, pid_q, pid_rk, stride_kp, stride_vp, stride_qr,
                           stride_qh, stride_qt, q_ptr, stride_or, stride_oh, stride_ot, T, G, scale_log2, offs_d,
                           offs_n, ones, HEAD_DIM, BLOCK_M, ROWS, QT, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS,
                           CHUNK, EMULATE, PRECISION)
        elif pid_s >= num_splits:
            if (all_chain == 0) & (pid_s - num_splits < tl.load(tail_base)):
                _chunk_splits(q_ptr, k_base, v_base, anc_base, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                              tail_base + 1 + (pid_s - num_splits) * (1 + CHUNK), r, kv, start, stride_kp, stride_vp,
                              stride_qr, stride_qh, stride_qt, T, G, num_kv, num_splits, scale_log2, offs_d, offs_n,
                              ones, HEAD_DIM, BLOCK_N, TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, EMULATE, PRECISION)
        elif (all_chain != 0) | (pid_s < (start // BLOCK_N) // TILES_PER_SPLIT):
            q, pos_row, max_pos = _program_rows(q_ptr, pos_ptr, r, t, head, row_ok, T, stride_qr, stride_qh,
                                                stride_qt, offs_d)
            m_i, l_i, acc = _split_state(q, k_base, v_base, row_ok, pos_row, max_pos, pid_s, stride_kp, stride_vp,
                                         scale_log2, offs_d, offs_n, ones, HEAD_DIM, BLOCK_M, BLOCK_N, TILES_PER_SPLIT,
                                         SUM_COLS, EMULATE, PRECISION)
            _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, r, t, head, row_ok, m_i, l_i, acc, pid_s, T, G,
                            num_kv, num_splits, offs_d, HEAD_DIM)

    @triton.jit
    def _store_partials(part_m_ptr, part_l_ptr, part_acc_ptr, r, t, head, row_ok, m_i, l_i, acc, split, T, G, num_kv,
                        num_splits, offs_d, HEAD_DIM: tl.constexpr):
        """One split's state of a program's rows as partials [R, T, H, splits] (+ D): written for every valid row,
        read by the combine only for splits up to its position."""
        part = ((r * T + t) * (num_kv * G) + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["T"])
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
        part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
        stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, T, G, num_kv, num_splits, scale_log2,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr,
        TILES_PER_SPLIT: tl.constexpr, SUM_COLS: tl.constexpr, TAIL_ROWS: tl.constexpr, CHUNK: tl.constexpr,
        SMALL_M: tl.constexpr, SMALL: tl.constexpr, FUSED: tl.constexpr, EMULATE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Grid (query tiles, splits + chunk slots (QT where T > 1) or 1 if FUSED, rows x KV heads):
        :func:`_attention_program`. Where SMALL, the last query tile of a call with several runs in a program of
        SMALL_M rows if its rows fit them (:func:`attention_small_tail`): the same rows, each with the same tile
        arithmetic, without the padding rows of a BLOCK_M-row program."""
        pid_q = tl.program_id(0)
        small = False
        if SMALL:  # the call's last tile, where its rows fit SMALL_M (a branch per program, one launch)
            small = (pid_q > 0) & ((T - pid_q * QT) * G <= SMALL_M)
        if small:
            _attention_program(
                q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
                part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
                stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, tl.program_id(1),
                tl.program_id(2), T, G, num_kv, num_splits, scale_log2, HEAD_DIM, SMALL_M, BLOCK_M, QT, BLOCK_N,
                TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, FUSED, EMULATE, PRECISION)
        else:
            _attention_program(
                q_ptr, k_ptr, v_ptr, slots_ptr, start_ptr, pos_ptr, anc_ptr, chain_ptr, tail_ptr, out_ptr, part_m_ptr,
                part_l_ptr, part_acc_ptr, state_ptr, stride_qr, stride_qh, stride_qt, stride_ks, stride_kh, stride_kp,
                stride_vs, stride_vh, stride_vp, stride_or, stride_oh, stride_ot, pid_q, tl.program_id(1),
                tl.program_id(2), T, G, num_kv, num_splits, scale_log2, HEAD_DIM, BLOCK_M, BLOCK_M, QT, BLOCK_N,
                TILES_PER_SPLIT, SUM_COLS, TAIL_ROWS, CHUNK, FUSED, EMULATE, PRECISION)

    @triton.jit(do_not_specialize=["T"])
    def _attention_combine_kernel(
        out_ptr, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_or, stride_oh, stride_ot, T, H, num_splits,
        HEAD_DIM: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    ):
        """Program (row x token, head): the stored split states 0 .. pos // SPLIT_KEYS merged in ascending order into a
        running max and rescaled sums (:func:`_merge_weights`, the fused launch's arithmetic), then out = acc / l
        (the same splits whatever the call's kv_len)."""
        rt = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        r = rt // T
        t = rt % T
        offs_d = tl.arange(0, HEAD_DIM)
        pos = tl.load(pos_ptr + rt)
        n = tl.minimum(pos // SPLIT_KEYS + 1, num_splits)
        base = (rt * H + h) * num_splits
        m_run = float("-inf")
        l_run = 0.0
        acc_run = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s in range(0, n):
            m_new, w_run, w_s = _merge_weights(m_run, tl.load(part_m_ptr + base + s))
            l_run = tl.fma(l_run, w_run, tl.load(part_l_ptr + base + s) * w_s)
            acc_run = tl.fma(acc_run, w_run, tl.load(part_acc_ptr + (base + s) * HEAD_DIM + offs_d) * w_s)
            m_run = m_new
        out = acc_run / tl.where(l_run > 0.0, l_run, 1.0)
        tl.store(out_ptr + r * stride_or + h * stride_oh + t * stride_ot + offs_d, out.to(out_ptr.dtype.element_ty))
