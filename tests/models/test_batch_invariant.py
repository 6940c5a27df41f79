"""Exact mode's kernels (ddtree.models.batch_invariant): a row's result is bit-identical whatever rides along.

References: the same row computed alone (1 row, AR decoding's layout), and for closeness ``F.linear`` and the
one-query-at-a-time torch path. Kernels run through Triton's interpreter on the CPU (tiny shapes), where the dot is
emulated with an fp32 ``tl.sum`` (the interpreter's BLAS dot is not row-invariant itself); the GPU tests at the end
run the compiled tensor-core kernels in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ddtree import triton_runtime  # noqa: E402
from ddtree.errors import ShapeError  # noqa: E402

# the modules that read each name, so a monkeypatch reaches every reader (ddtree.models.batch_invariant's docstring)
from ddtree.models.batch_invariant import attention_launch as bia  # noqa: E402
from ddtree.models.batch_invariant import attention_rules as rules  # noqa: E402
from ddtree.models.batch_invariant import attention_tables as tables  # noqa: E402
from ddtree.models.batch_invariant import matmul as bim  # noqa: E402

if not torch.cuda.is_available() and not triton_runtime.INTERPRETED:
    pytest.skip("no CUDA device and Triton's interpreter is off", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = (1, 2, 17, 64, 257)


@pytest.fixture(autouse=True)
def kernel_on(triton_kernels_on_cpu):
    yield


# ---- matmul -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 80), (48, 512)])  # one split; two K splits (matmul_tiles)
def test_linear_rows_bit_identical_to_one_row(dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(max(ROWS), k, generator=gen).to(dtype).to(DEVICE)
    alone = bim.linear(x[:1], w, b)  # row 0 computed alone
    last_alone = {m: bim.linear(x[m - 1:m], w, b) for m in ROWS}
    for m in ROWS:
        y = bim.linear(x[:m], w, b)
        assert torch.equal(y[:1], alone), f"row 0 changes at {m} rows"
        assert torch.equal(y[m - 1:m], last_alone[m]), f"row {m - 1} changes at {m} rows"
    full = bim.linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert ((full.float() - ref).abs() <= tol * (1 + ref.abs())).all()
    if shape == (48, 512):
        assert bim.matmul_tiles(n, k).split_k == 2  # the split-K path ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [512, 500])  # 500: the last K block is masked
def test_linear_launches_give_the_same_bits(dtype, k):
    # split programs + the ordered sum kernel against fused programs that walk the segments themselves, and
    # different row tiles: every row equal to its row alone under the default launch, with and without a bias
    n = 40
    tiles = bim.MatmulTiles(block_k=64, split_k=4)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(40, k, generator=gen).to(dtype).to(DEVICE)  # 3 tiles of 16 rows, 2 of 32, part of one of 64
    launches = [bim.MatmulLaunch(16, 32, 4, 2, fused=False), bim.MatmulLaunch(16, 32, 4, 2, fused=True),
                bim.MatmulLaunch(32, 64, 4, 2, fused=True), bim.MatmulLaunch(64, 16, 4, 2, fused=False),
                bim.MatmulLaunch(32, 32, 4, 2, fused=True, flat=True),
                bim.MatmulLaunch(32, 32, 4, 2, fused=True, flat=True, tma=True),
                bim.MatmulLaunch(16, 32, 4, 2, fused=False, tma=True)]
    # rows of 16-byte multiples load through descriptors (K past the end padded with zeros); 500 bf16 do not
    assert bim._descriptors_fit(x, w) == (k * x.element_size() % 16 == 0)
    for bias in (None, b):
        alone = torch.cat([bim.linear(x[i:i + 1], w, bias, tiles=tiles, launch=launches[0]) for i in range(x.shape[0])])
        for launch in launches:
            for m in (1, 2, 17, 40):
                y = bim.linear(x[:m], w, bias, tiles=tiles, launch=launch)
                assert torch.equal(y, alone[:m]), f"{launch} at {m} rows differs from the rows alone"
    # and the split count does change the bits (so the test can tell the launches apart from the tiles; in fp32,
    # where the output keeps the accumulator's rounding)
    if dtype == torch.float32:
        other = bim.linear(x, w, None, tiles=bim.MatmulTiles(block_k=64, split_k=1))
        assert not torch.equal(other, bim.linear(x, w, None, tiles=tiles))


def test_whole_waves_split_only_past_a_wave_with_a_rest_of_its_own_launch():
    # Qwen3-8B's down on 132 SMs: 16 column tiles of 256 a row tile of 128 -> 8 row tiles (1024 rows) a wave
    n, k, wave = 4096, 12288, 128 * (132 // 16)
    assert bim.matmul_launch(n, k, 1088) == bim.MATMUL_WIDE_LAUNCH
    assert bim._whole_waves(n, k, 1088, True, wave) == 1024  # DDTree 16 at 64 in flight: 1024 wide + 64 apart
    assert bim._whole_waves(n, k, 1024 + 512, True, wave) == 1024  # a rest the flat 128 x 128 launch takes
    assert bim._whole_waves(n, k, 1024 + 513, True, wave) == 0  # a rest that is wide itself: one launch
    assert bim._whole_waves(n, k, 2048, True, wave) == 0  # whole waves only
    assert bim._whole_waves(n, k, 1000, True, wave) == 0  # one wave or less
    assert bim._whole_waves(n, k, 1088, True, 0) == 0  # off CUDA
    assert bim.matmul_wave_rows(n, k, torch.device("cpu")) == 0


def test_linear_split_into_whole_waves_gives_the_same_bits(monkeypatch):
    # the whole waves' rows and the rest in two launches writing two slices of one output: every row as in one
    # launch (a small table here, so the interpreter's dots fit: wide = fused 32 x 32 from 41 rows, split below)
    n, k = 40, 256
    tiles = bim.MatmulTiles(block_k=64, split_k=4)
    split, wide = bim.MatmulLaunch(16, 32, 4, 2, fused=False, tma=True), bim.MatmulLaunch(32, 32, 4, 2, fused=True,
                                                                                       flat=True, tma=True)
    seen = []
    monkeypatch.setattr(bim, "matmul_launch", lambda n_, k_, m, tma=True: split if m <= 40 else wide)
    into = bim._linear_into
    monkeypatch.setattr(bim, "_linear_into", lambda x2, *a: seen.append(x2.shape[0]) or into(x2, *a))
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE)
    x = torch.randn(100, k, generator=gen).to(DEVICE)
    ref = bim.linear(x, w, b, tiles=tiles, launch=split)
    for m, parts in ((100, [96, 4]), (70, [64, 6]), (64, [64]), (90, [64, 26])):
        seen.clear()
        y = bim.linear(x[:m].reshape(2, m // 2, k) if m % 2 == 0 else x[:m], w, b, tiles=tiles, wave_rows=32)
        assert seen == parts, m
        assert torch.equal(y.reshape(m, n), ref[:m]), f"{m} rows split as {parts}"


def test_matmul_launch_by_rows():
    # decode: split programs in small row tiles; wide: fused programs in large tiles (matmul_tiles stays)
    assert not bim.matmul_launch(4096, 12288, 1).fused and bim.matmul_launch(4096, 12288, 1).block_m == 16
    assert bim.matmul_launch(4096, 12288, 768).fused and bim.matmul_launch(4096, 12288, 768).block_m == 128
    # the flat launch's tiles by the waves they fill on 132 SMs at N = 4096: 64 x 128 to 256 rows, 128 x 128 to 512
    assert [bim.matmul_launch(4096, 12288, m)[:2] for m in (256, 257, 512, 513)] == [(64, 128), (128, 128),
                                                                                    (128, 128), (128, 256)]
    assert bim.matmul_launch(24576, 4096, 1).block_m == 64  # one segment: nothing for small tiles to spread
    # tensor-descriptor loads from 17 rows where the device has them, the pointer table elsewhere and for weights
    # of one K segment (timed on 4-segment weights only)
    assert bim.matmul_launch(4096, 12288, 320).tma and not bim.matmul_launch(4096, 12288, 320, tma=False).tma
    assert bim.matmul_launch(4096, 12288, 17).tma and not bim.matmul_launch(4096, 12288, 16).tma
    assert not any(bim.matmul_launch(151936, 4096, m).tma for m in (1, 64, 320, 768, 4096))
    assert not any(bim.matmul_launch(4096, 12288, m, tma=False).tma for m in (1, 64, 320, 768, 4096))


class _Spy:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_tma_launch_loads_through_descriptors_or_runs_the_pointer_table(monkeypatch):
    """A descriptor launch runs the descriptor kernel; with x's base off 16 bytes it runs the pointer table's
    launch for its rows (not the descriptor launch's tiles through pointers), with the same bits; a split launch
    keeps its descriptors when only the output's rows are off 16 bytes (it stores partials through pointers)."""
    spies = {name: _Spy(getattr(bim, name)) for name in ("_matmul_kernel", "_matmul_tma_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(bim, name, spy)
    gen = torch.Generator().manual_seed(4)
    k, n, m = 512, 40, 200
    tiles = bim.MatmulTiles(block_k=64, split_k=4)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ref = bim.linear(x, w, tiles=tiles, launch=bim.MatmulLaunch(64, 64, 4, 2, fused=False))
    flat = bim.MatmulLaunch(32, 32, 4, 2, fused=True, flat=True, tma=True)
    spies["_matmul_tma_kernel"].grids.clear()
    spies["_matmul_kernel"].grids.clear()
    assert torch.equal(bim.linear(x, w, tiles=tiles, launch=flat), ref)
    assert spies["_matmul_tma_kernel"].grids == [(7, 2, 1)] and spies["_matmul_kernel"].grids == []
    storage = torch.empty(m * k + 1, dtype=torch.bfloat16)
    storage[1:] = x.flatten()
    shifted = storage[1:].view(m, k)  # the same values, the base 2 bytes off
    assert not bim._descriptors_fit(shifted)
    assert torch.equal(bim.linear(shifted, w, tiles=tiles, launch=flat), ref)
    pointer = bim.matmul_launch(n, k, m, tma=False)
    assert spies["_matmul_tma_kernel"].grids == [(7, 2, 1)]
    assert spies["_matmul_kernel"].grids == [(-(-m // pointer.block_m), -(-n // pointer.block_n),
                                              1 if pointer.fused else tiles.split_k)]
    odd = torch.randn(41, k, generator=gen).to(torch.bfloat16)  # output rows of 82 bytes
    split = bim.MatmulLaunch(32, 32, 4, 2, fused=False, tma=True)
    odd_ref = bim.linear(x, odd, tiles=tiles, launch=bim.MatmulLaunch(64, 64, 4, 2, fused=False))
    spies["_matmul_tma_kernel"].grids.clear()
    assert torch.equal(bim.linear(x, odd, tiles=tiles, launch=split), odd_ref)
    assert spies["_matmul_tma_kernel"].grids == [(7, 2, 4)]


def test_linear_no_bias_and_leading_dims():
    w = torch.randn(24, 32, device=DEVICE)
    x = torch.randn(3, 5, 32, device=DEVICE)
    y = bim.linear(x, w)
    assert y.shape == (3, 5, 24)
    assert torch.equal(y[1, 2], bim.linear(x[1, 2:3], w)[0])
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_matmul_tiles_depend_on_the_weight_only():
    # the Qwen3-8B projections: qkv, o_proj, gate/up, down, LM head
    assert bim.matmul_tiles(4096, 4096).split_k == 4
    assert bim.matmul_tiles(4096, 12288).split_k == 4
    assert bim.matmul_tiles(24576, 4096).split_k == 1
    assert bim.matmul_tiles(151936, 4096).split_k == 1


def test_linear_rejects_bad_shapes():
    with pytest.raises(ShapeError, match="does not fit"):
        bim.linear(torch.randn(2, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE))


def test_linear_rows_torch_path():
    w, b = torch.randn(24, 32), torch.randn(24)
    x = torch.randn(17, 32)
    y = bim.linear_rows(x, w, b)
    assert torch.equal(y[3], bim.linear_rows(x[3:4], w, b)[0])
    torch.testing.assert_close(y, F.linear(x, w, b))


# ---- attention ----------------------------------------------------------------------------------------------------

PARENTS = (-1, 0, 0, 1, 3, 2, 4)  # root; a, b under it; c under a; d under c; e under b; f under d
# 20 nodes: with G query heads per KV head its programs fold 64 rows (T x G = 40, attention_block_m)
WIDE = (-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
KV, G, D = 2, 2, 16


def _tree(parents):
    t = len(parents)
    vis = torch.zeros(1, t, t, dtype=torch.bool)
    depth = []
    for i in range(t):
        j, d = i, -1
        while j >= 0:
            vis[0, i, j] = True
            j, d = parents[j], d + 1
        depth.append(d)
    return vis, torch.tensor(depth)


def _ar_layout(kc, vc, slot_from, slot_to, start, path):
    """Copy slot_from's prefix and the nodes of ``path`` (cache indices start + node) to slot_to contiguously: the
    cache AR decoding of the same tokens would hold."""
    kc[slot_to, :, :start] = kc[slot_from, :, :start]
    vc[slot_to, :, :start] = vc[slot_from, :, :start]
    for d, node in enumerate(path):
        kc[slot_to, :, start + d] = kc[slot_from, :, start + node]
        vc[slot_to, :, start + d] = vc[slot_from, :, start + node]


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _run(fn, q, kc, vc, slots, start, pos, vis, kv_len):
    anc, chain = tables.ancestor_map(start, pos, vis)
    if fn is bia.attention:
        return bia.attention(q, kc, vc, slots, start, pos, anc, chain, kv_len, split_keys=64)
    return bia.attention_rows(q, kc, vc, slots, start, pos, anc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [bia.attention, bia.attention_rows], ids=["triton", "torch"])
@pytest.mark.parametrize("start", [0, 60, 130])  # keys in one tile; a tree across a tile edge; three splits
def test_tree_node_equals_its_ar_decode(dtype, fn, start):
    gen = torch.Generator().manual_seed(start)
    t = len(PARENTS)
    length = 256
    kc = torch.randn(3, KV, length, D, generator=gen).to(dtype)
    vc = torch.randn(3, KV, length, D, generator=gen).to(dtype)
    q = torch.randn(1, KV * G, t, D, generator=gen).to(dtype)
    vis, depth = _tree(PARENTS)
    s0 = torch.tensor([start])
    pos = s0[:, None] + depth[None]
    out = _run(fn, q, kc, vc, torch.tensor([0]), s0, pos, vis, kv_len=start + t)
    for node in range(t):
        path = _path(PARENTS, node)
        _ar_layout(kc, vc, 0, 1, start, path)
        p = start + len(path) - 1
        for kv_len in (p + 1, 192, 256):  # every key-length bucket the AR step could run in
            ar = _run(fn, q[:, :, node:node + 1], kc, vc, torch.tensor([1]), torch.tensor([p]), torch.tensor([[p]]),
                      torch.ones(1, 1, 1, dtype=torch.bool), kv_len)
            assert torch.equal(ar[0, :, 0], out[0, :, node]), f"node {node} at kv_len {kv_len}"
        # ... and as the last token of a prompt chunk (causal, contiguous) that starts mid-path
        chunk = torch.tensor([max(0, p - 3)])
        n = p - int(chunk) + 1
        ch = _run(fn, q[:, :, node:node + 1].expand(1, KV * G, n, D).contiguous(), kc, vc, torch.tensor([1]), chunk,
                  chunk[:, None] + torch.arange(n)[None], torch.tril(torch.ones(1, n, n, dtype=torch.bool)), 256)
        assert torch.equal(ch[0, :, -1], out[0, :, node]), f"node {node} as a prompt chunk's last token"
    if fn is bia.attention:
        ref = _run(bia.attention_rows, q, kc, vc, torch.tensor([0]), s0, pos, vis, start + t)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


class _NaNPartials:
    """``bia.torch`` for a test: fp32 buffers of four dims and more (the split launch's partials) come filled with NaN,
    so a partial the combine kernel reads and no program wrote shows in the output (fresh ``torch.empty`` memory is
    often zeros on the CPU, which merge as an empty split)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        x = torch.empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.dtype == torch.float32 and x.dim() >= 4 else x

    @staticmethod
    def empty_like(x, **kwargs):
        y = torch.empty_like(x, **kwargs)
        return y.fill_(float("nan")) if y.dtype == torch.float32 else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [130, 200])  # the split holding start has 2 or 3 whole tiles below start's tile
def test_chunk_programs_read_their_splits_shared_tiles(monkeypatch, dtype, start):
    """Four tiles a split (the engine's 256 keys): the split launch's chunk programs run the split holding ``start``
    from its first tile, whole prefix tiles included, as each node's AR step and the fused launch do; every partial
    the combine kernel reads was written (NaN-filled partials)."""
    monkeypatch.setattr(bia, "torch", _NaNPartials())
    gen = torch.Generator().manual_seed(start)
    t = len(PARENTS)
    kc = torch.randn(3, KV, 512, D, generator=gen).to(dtype)
    vc = torch.randn(3, KV, 512, D, generator=gen).to(dtype)
    q = torch.randn(1, KV * G, t, D, generator=gen).to(dtype)
    vis, depth = _tree(PARENTS)
    s0 = torch.tensor([start])
    pos = s0[:, None] + depth[None]
    anc, chain = tables.ancestor_map(s0, pos, vis)
    args = (q, kc, vc, torch.tensor([0]), s0, pos, anc, chain, 512)
    out = bia.attention(*args, fused=False)
    assert torch.equal(bia.attention(*args, fused=True), out)
    assert torch.equal(bia.attention(*args, fused=False, tail=tables.single_chunks(1, t, G, q.device, KV)), out)
    for node in range(t):
        path = _path(PARENTS, node)
        _ar_layout(kc, vc, 0, 1, start, path)
        p = start + len(path) - 1
        a1, c1 = tables.ancestor_map(torch.tensor([p]), torch.tensor([[p]]), torch.ones(1, 1, 1, dtype=torch.bool))
        ar = bia.attention(q[:, :, node:node + 1], kc, vc, torch.tensor([1]), torch.tensor([p]), torch.tensor([[p]]),
                          a1, c1, 512, fused=False)
        assert torch.equal(ar[0, :, 0], out[0, :, node]), f"node {node}"
    assert not out.isnan().any()


def test_attention_row_independent_of_other_rows():
    """One request's tree alone vs beside two others (different starts and slots, padded batch)."""
    gen = torch.Generator().manual_seed(3)
    t = len(PARENTS)
    kc = torch.randn(4, KV, 256, D, generator=gen)
    vc = torch.randn(4, KV, 256, D, generator=gen)
    q = torch.randn(3, KV * G, t, D, generator=gen)
    vis, depth = _tree(PARENTS)
    start = torch.tensor([70, 5, 200])
    pos = start[:, None] + depth[None]
    vis3 = vis.expand(3, t, t).contiguous()
    anc, chain = tables.ancestor_map(start, pos, vis3)
    together = bia.attention(q, kc, vc, torch.tensor([2, 0, 3]), start, pos, anc, chain, 256, split_keys=64)
    a1, c1 = tables.ancestor_map(start[:1], pos[:1], vis)
    alone = bia.attention(q[:1], kc, vc, torch.tensor([2]), start[:1], pos[:1], a1, c1, 128, split_keys=64)
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [G, 4], ids=["one 64-row tile", "three 32-row tiles"])
@pytest.mark.parametrize("split_keys", [64, 128], ids=["a split per tile", "two tiles per split"])
def test_fused_launch_gives_the_split_launch_bits(dtype, group, split_keys):
    """Three rows at different starts (one split, a tree across a split edge, three splits; rows of a program with
    different split counts) and a chain: the fused launch (each program merges its splits in one loop over the
    tiles, a tree's tail tiles one query at a time) against the split launch (stored partials and the combine
    kernel), in two and in three pipeline stages (three on a GPU: the interpreter ignores stages). At 4 query heads
    per KV head the 20-node tree folds into three query tiles, the last one partial. At a split per tile the tree at
    start 60 has its tail across a split edge; at two tiles per split the tree at 150 starts its tail with a split
    (tiles 0-1 shared, split 1 from the tail's tile 2)."""
    gen = torch.Generator().manual_seed(11)
    t = len(WIDE)
    kc = torch.randn(4, KV, 256, D, generator=gen).to(dtype)
    vc = torch.randn(4, KV, 256, D, generator=gen).to(dtype)
    q = torch.randn(3, KV * group, t, D, generator=gen).to(dtype)
    vis, depth = _tree(WIDE)
    start = torch.tensor([20, 60, 150])
    pos = start[:, None] + depth[None]
    anc, chain = tables.ancestor_map(start, pos, vis.expand(3, t, t).contiguous())
    args = (q, kc, vc, torch.tensor([2, 0, 3]), start, pos, anc, chain, 256)
    split = bia.attention(*args, split_keys=split_keys, fused=False)
    fused = bia.attention(*args, split_keys=split_keys, fused=True)
    assert torch.equal(fused, split)
    if not triton_runtime.INTERPRETED:  # the interpreter ignores pipeline stages: the same run as the line above
        assert torch.equal(bia.attention(*args, split_keys=split_keys, fused=True, num_stages=3), split)
    causal = torch.tril(torch.ones(1, 9, 9, dtype=torch.bool))
    cstart = torch.tensor([60])
    cpos = cstart[:, None] + torch.arange(9)[None]
    canc, cchain = tables.ancestor_map(cstart, cpos, causal)
    cargs = (q[:1, :, :9], kc, vc, torch.tensor([1]), cstart, cpos, canc, cchain, 192)
    assert torch.equal(bia.attention(*cargs, split_keys=split_keys, fused=True),
                       bia.attention(*cargs, split_keys=split_keys, fused=False))


def _wide_tree_call(seed: int, starts: tuple[int, int], slots: tuple[int, int]) -> tuple:
    """bia.attention's arguments for two rows of the 20-node tree WIDE at 4 query heads per KV head (80 folded rows),
    bf16, over random caches of 3 slots x 256 positions."""
    gen = torch.Generator().manual_seed(seed)
    t = len(WIDE)
    kc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    vc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, KV * 4, t, D, generator=gen).to(torch.bfloat16)
    vis, depth = _tree(WIDE)
    start = torch.tensor(starts)
    pos = start[:, None] + depth[None]
    anc, chain = tables.ancestor_map(start, pos, vis.expand(2, t, t).contiguous())
    return (q, kc, vc, torch.tensor(slots), start, pos, anc, chain, 256)


@pytest.mark.parametrize("large_block_m", [64, 128])
def test_large_tree_programs_give_the_bits_of_small_ones(monkeypatch, large_block_m):
    """A 20-node tree at 4 query heads per KV head (80 folded rows) in programs of 64 and 128 rows (the large-tree
    launch choice, ATTN_LARGE_BLOCK_M; its threshold and the fused grid's lowered for the tiny shape) against
    programs of 32, both launches, bf16."""
    t = len(WIDE)
    args = _wide_tree_call(13, starts=(60, 130), slots=(2, 0))
    q = args[0]
    assert rules.attention_block_m(t, 4, 2 * KV) == rules.ATTN_BLOCK_M  # 80 folded rows: their 64-row grid is small
    small = bia.attention(*args, fused=False)
    small_layout = tables.single_chunks(2, t, 4, q.device, KV)
    monkeypatch.setattr(rules, "ATTN_LARGE_BLOCK_M", large_block_m)
    monkeypatch.setattr(rules, "ATTN_LARGE_MIN_FOLDED", 64)
    monkeypatch.setattr(rules, "ATTN_FUSED_MIN_PROGRAMS", 1)
    assert rules.attention_block_m(t, 4, 2 * KV) == large_block_m
    for fused in (False, True):
        assert torch.equal(bia.attention(*args, fused=fused), small), f"fused={fused}"
    # the table must be laid out for the call's programs: one made for 32-row programs is refused
    with pytest.raises(ShapeError, match="tail"):
        bia.attention(*args, tail=small_layout)


def test_wide_programs_give_the_bits_of_small_ones(monkeypatch):
    """One 128-row program per row and KV head for a 20-node tree (ATTN_WIDE_*: its call's rows x KV heads in the
    wide range) launches fused when ATTN_WIDE_FUSED, else split, and gives the bits of 32-row programs."""
    t = len(WIDE)
    args = _wide_tree_call(17, starts=(70, 140), slots=(1, 2))
    small = bia.attention(*args)
    assert rules.attention_block_m(t, 4, 2 * KV) == rules.ATTN_BLOCK_M and not rules.launches_fused(t, 4, 2 * KV)
    monkeypatch.setattr(rules, "ATTN_WIDE_MIN_PER_TILE", 2 * KV)
    monkeypatch.setattr(rules, "ATTN_WIDE_MAX_PER_TILE", 2 * KV)
    assert rules.attention_block_m(t, 4, 2 * KV) == rules.ATTN_WIDE_BLOCK_M == 128
    assert rules.attention_block_m(t, 4, 4 * KV) == rules.ATTN_BLOCK_M  # past the range: as before
    assert rules.attention_warps(128) == rules.ATTN_WIDE_WARPS and rules.attention_warps(64) == rules.ATTN_NUM_WARPS
    for wide_fused in (True, False):
        monkeypatch.setattr(rules, "ATTN_WIDE_FUSED", wide_fused)
        assert rules.launches_fused(t, 4, 2 * KV) == wide_fused == rules.groups_tails(2, t, 4, KV)
        assert torch.equal(bia.attention(*args), small), f"wide fused={wide_fused}"


@pytest.mark.parametrize("nodes", [17, 20, 33])
def test_small_last_tiles_give_the_bits_of_full_ones(monkeypatch, nodes):
    """The last query tile in a program of 16 rows (ATTN_SMALL_TAIL_ROWS) where it holds at most 16 folded rows: a
    17-node tree in 32-row programs (4 rows left), a 20-node one in 64-row programs (16 left) and a 33-node one in
    64-row programs (4 left), against full-size programs, both launches, the tails grouped and a chunk per query."""
    parents = WIDE + tuple(range(14, 27))
    gen = torch.Generator().manual_seed(nodes)
    kc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    vc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, KV * 4, nodes, D, generator=gen).to(torch.bfloat16)
    vis, depth = _tree(parents[:nodes])
    start = torch.tensor((60, 130))
    pos = start[:, None] + depth[None]
    anc, chain = tables.ancestor_map(start, pos, vis.expand(2, nodes, nodes).contiguous())
    args = (q, kc, vc, torch.tensor((2, 0)), start, pos, anc, chain, 256)
    if nodes > 17:
        monkeypatch.setattr(rules, "ATTN_LARGE_MIN_FOLDED", 64)
        monkeypatch.setattr(rules, "ATTN_FUSED_MIN_PROGRAMS", 1)
    monkeypatch.setattr(rules, "ATTN_SMALL_TAIL_ROWS", 0)
    full = bia.attention(*args, fused=False)
    monkeypatch.setattr(rules, "ATTN_SMALL_TAIL_ROWS", 16)
    assert rules.attention_small_tail(nodes, 4, 2 * KV)
    assert rules.attention_block_m(nodes, 4, 2 * KV) == (32 if nodes == 17 else 64)
    for fused in (False, True):
        for tail in (tables.tail_chunks(anc, pos, start, 4, KV), tables.single_chunks(2, nodes, 4, pos.device, KV)):
            assert torch.equal(bia.attention(*args, fused=fused, tail=tail), full), f"fused={fused}"


def test_forward_tail_is_the_forwards_choice_of_table():
    # grouped only where the queries branch and the calls launch fused; a chunk per query otherwise
    vis, depth = _tree(WIDE[:17])
    for rows in (1, 64):
        start = torch.arange(rows) * 7 + 100
        pos = start[:, None] + depth[None]
        anc, _ = tables.ancestor_map(start, pos, vis.expand(rows, 17, 17).contiguous())
        grouped = tables.tail_chunks(anc, pos, start, 4, 8)
        single = tables.single_chunks(rows, 17, 4, pos.device, 8)
        fused = rules.groups_tails(rows, 17, 4, 8)
        assert fused == (rows == 64)
        assert torch.equal(tables.forward_tail(anc, pos, start, 4, 8), grouped if fused else single)
        assert torch.equal(tables.forward_tail(anc, pos, start, 4, 8, branches=False), single)
    assert not torch.equal(grouped, single)  # the two tables differ here, so the choice is seen


def test_large_tree_rule():
    # a served 64-node tree at G = 4: 64-row programs where that grid launches fused (C = 8, 8 KV heads), else 32
    assert rules.attention_block_m(64, 4, 8 * 8) == rules.ATTN_LARGE_BLOCK_M == 64
    assert rules.attention_block_m(64, 4, 1 * 8) == rules.ATTN_BLOCK_M
    assert rules.attention_block_m(32, 4, 8 * 8) == rules.ATTN_BLOCK_M  # 128 folded rows at C = 8: the grid is small
    # a served 17-node tree (68 folded rows) at C = 64: 64-row programs, two a row and KV head; at C = 8: 32 rows;
    # either way the last program (one query, 4 rows) a 16-row one
    assert rules.attention_block_m(17, 4, 64 * 8) == rules.ATTN_LARGE_BLOCK_M
    assert rules.attention_block_m(17, 4, 8 * 8) == rules.ATTN_BLOCK_M
    assert all(rules.attention_small_tail(17, 4, per_tile) for per_tile in (1 * 8, 8 * 8, 64 * 8))
    assert not rules.attention_small_tail(16, 4, 64 * 8) and not rules.attention_small_tail(1, 4, 64 * 8)  # one tile
    assert rules.attention_small_tail(33, 4, 64 * 8) and not rules.attention_small_tail(21, 4, 64 * 8)  # 4 and 20 rows left
    assert rules.tail_layout(64, 4, 64)[0] == 16 and rules.tail_layout(64, 4, 8)[0] == 8
    # tails grouped where the calls launch fused (chunks one after another in a program), not in the split launch
    assert rules.groups_tails(8, 64, 4, 8) and rules.groups_tails(64, 17, 4, 8)
    assert not rules.groups_tails(1, 64, 4, 8) and not rules.groups_tails(1, 17, 4, 8)
    assert all(rules.groups_tails(r, t, 4, 8) == rules.attention_fused(-(-t // rules.tail_layout(t, 4, r * 8)[0]) * r * 8)
               for r in (1, 2, 4, 8, 16, 64) for t in (1, 5, 9, 17, 33, 64))


def _same_depth_sight() -> tuple[torch.Tensor, torch.Tensor]:
    """Not a tree: a root and four nodes at depth 1 where node 1 sees node 2 and node 3 sees node 4 (ancestor_map
    then gives 1 and 2 one path, and 3 and 4 another): (visibility [1, 5, 5], depths [5])."""
    vis = torch.eye(5, dtype=torch.bool)[None].clone()
    vis[0, 1:, 0] = True
    vis[0, 1, 2] = vis[0, 3, 4] = True
    return vis, torch.tensor([0, 1, 1, 1, 1])


def test_tail_chunks_of_equal_paths_and_of_nothing():
    """Queries whose paths are equal (each under the other) get one chunk per path, never a chunk that mixes paths;
    no rows or no tokens give an empty table and an empty attention."""
    vis, depth = _same_depth_sight()
    start = torch.tensor([100])
    pos = start[:, None] + depth[None]
    anc, chain = tables.ancestor_map(start, pos, vis)
    row = tables.tail_chunks(anc, pos, start, 4)[0, 0].tolist()
    per = rules.tail_layout(5, 4)[1]
    chunks = [row[1 + c * (1 + per):1 + (c + 1) * (1 + per)] for c in range(row[0])]
    paths = anc[0].tolist()
    for lead, *members in chunks:
        for m in (m for m in members if m >= 0):
            d = int(depth[m])
            assert paths[m][:d + 1] == paths[lead][:d + 1], (lead, m)
    assert sorted(m for _, *ms in chunks for m in ms if m >= 0) == [0, 1, 2, 3, 4]
    q = torch.randn(0, 4, 3, D)
    empty = bia.attention(q, torch.randn(1, 1, 64, D), torch.randn(1, 1, 64, D), torch.zeros(0, dtype=torch.long),
                         torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long),
                         torch.zeros(0, 3, 3, dtype=torch.int32), torch.zeros(0, 3, dtype=torch.int32), 64)
    assert empty.shape == (0, 4, 3, D)
    assert tables.tail_chunks(torch.zeros(0, 3, 3, dtype=torch.int32), torch.zeros(0, 3, dtype=torch.long),
                          torch.zeros(0, dtype=torch.long), 4).shape[0] == 0


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_grouped_tail_gives_the_bits_of_a_query_alone(fused):
    """The 20-node tree in three query tiles, the 7-node one in one, and a visibility with equal paths:
    tail_chunks' grouping against every query its own chunk (single_chunks: each gathers its own tile, as before
    the grouping) in both launches."""
    gen = torch.Generator().manual_seed(5)
    for parents, group in ((WIDE, 4), (PARENTS, G), (None, 4)):  # None: equal paths (not a tree)
        vis, depth = _tree(parents) if parents else _same_depth_sight()
        t = len(depth)
        kc = torch.randn(3, KV, 256, D, generator=gen)
        vc = torch.randn(3, KV, 256, D, generator=gen)
        q = torch.randn(2, KV * group, t, D, generator=gen)
        start = torch.tensor([60, 150])
        pos = start[:, None] + depth[None]
        anc, chain = tables.ancestor_map(start, pos, vis.expand(2, t, t).contiguous())
        args = (q, kc, vc, torch.tensor([2, 0]), start, pos, anc, chain, 256)
        grouped = bia.attention(*args, split_keys=64, fused=fused)
        alone = bia.attention(*args, split_keys=64, fused=fused, tail=tables.single_chunks(2, t, group, q.device))
        assert torch.equal(grouped, alone), (t, group)


def test_attention_fused_by_grid_size():
    assert not rules.attention_fused(rules.ATTN_FUSED_MIN_PROGRAMS - 1)
    assert rules.attention_fused(rules.ATTN_FUSED_MIN_PROGRAMS)
    assert rules.attention_fused(64 * 8)  # AR at C = 64 with 8 KV heads


def test_ancestor_map_of_a_tree_and_a_chunk():
    vis, depth = _tree((-1, 0, 0, 1))
    anc, chain = tables.ancestor_map(torch.tensor([5]), 5 + depth[None], vis)
    assert anc[0].tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1]]
    assert chain[0].tolist() == [1, 1, 0, 0]
    causal = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    _, chain = tables.ancestor_map(torch.tensor([9]), 9 + torch.arange(3)[None], causal)
    assert chain[0].tolist() == [1, 1, 1]


def _random_parents(t: int, gen: torch.Generator) -> tuple[int, ...]:
    return (-1,) + tuple(int(torch.randint(i, (1,), generator=gen)) for i in range(1, t))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 16, 20, 64])
def test_tail_chunks_cover_every_query_once_on_one_path(group, tokens):
    """Against a brute-force reading of the table: every query of each program in exactly one chunk of that program,
    at most C members, each member's path a prefix of the lead's (so the lead's gathered keys are the member's at
    every position it sees), the lead the deepest member; and runs are as long as C allows on a chain."""
    gen = torch.Generator().manual_seed(tokens * 10 + group)
    trees = [_random_parents(tokens, gen), _random_parents(tokens, gen), (-1,) + tuple(range(tokens - 1))]
    vis = torch.cat([_tree(p)[0] for p in trees])
    depth = torch.stack([_tree(p)[1] for p in trees])
    start = torch.tensor([0, 70, 300])
    pos = start[:, None] + depth
    anc, _ = tables.ancestor_map(start, pos, vis)
    table = tables.tail_chunks(anc, pos, start, group)
    qt, per = rules.tail_layout(tokens, group)
    assert table.shape == (3, -(-tokens // qt), 1 + qt * (1 + per))
    for r, parents in enumerate(trees):
        paths = [_path(parents, node) for node in range(tokens)]
        for p in range(table.shape[1]):
            row = table[r, p].tolist()
            chunks = [row[1 + c * (1 + per):1 + (c + 1) * (1 + per)] for c in range(row[0])]
            seen = []
            for lead, *members in chunks:
                members = [m for m in members if m >= 0]
                assert members and len(members) <= per and lead in members
                for m in members:
                    assert paths[lead][:len(paths[m])] == paths[m], (r, p, lead, m)
                assert len(paths[lead]) == max(len(paths[m]) for m in members)
                seen += members
            assert sorted(seen) == list(range(p * qt, min(tokens, (p + 1) * qt)))
        if r == 2:  # the chain: full runs of C in each program
            assert sum(table[r, :, 0].tolist()) == sum(-(-min(qt, tokens - p * qt) // per)
                                                       for p in range(table.shape[1]))


# ---- GPU: the compiled kernels in bf16 ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)])
def test_gpu_linear_rows_bit_identical(shape):
    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    alone = bim.linear(x[:1], w)
    full = bim.linear(x, w)  # the wide launch (128-row fused tiles); every row count below launches differently
    assert torch.equal(full[:1], alone)
    for m in (1, 2, 8, 16, 17, 32, 64, 65, 128, 129, 257, 512, 767, 768, 1024, 2048):
        assert torch.equal(bim.linear(x[:m], w), full[:m]), f"rows change at {m} rows"


def test_wide_tree_node_equals_its_ar_decode():
    """A tree whose programs fold 64 rows (T x G = 40) against AR steps folded in 32 (the interpreter)."""
    gen = torch.Generator().manual_seed(5)
    t = len(WIDE)
    assert rules.attention_block_m(t, G) == 64 and rules.attention_block_m(1, G) == rules.ATTN_BLOCK_M
    kc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    vc = torch.randn(3, KV, 256, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, KV * G, t, D, generator=gen).to(torch.bfloat16)
    vis, depth = _tree(WIDE)
    s0 = torch.tensor([60])
    out = _run(bia.attention, q, kc, vc, torch.tensor([0]), s0, s0[:, None] + depth[None], vis, kv_len=60 + t)
    for node in range(t):
        path = _path(WIDE, node)
        _ar_layout(kc, vc, 0, 1, 60, path)
        p = 60 + len(path) - 1
        ar = _run(bia.attention, q[:, :, node:node + 1], kc, vc, torch.tensor([1]), torch.tensor([p]),
                  torch.tensor([[p]]), torch.ones(1, 1, 1, dtype=torch.bool), p + 1)
        assert torch.equal(ar[0, :, 0], out[0, :, node]), f"node {node}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("parents", [PARENTS, WIDE[:12], WIDE[:17], WIDE],
                         ids=["7 nodes", "12 nodes (64-row programs)", "17 nodes (a 16-row last program)",
                              "20 nodes (a 16-row last program)"])
@pytest.mark.parametrize("start", [100, 1000, 3000])
def test_gpu_tree_node_equals_its_ar_decode(start, parents):
    PARENTS = parents  # noqa: N806 (the tree under test)
    kv, g, d, t = 8, 4, 128, len(PARENTS)
    kc = torch.randn(3, kv, 4096, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(3, kv, 4096, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, kv * g, t, d, device="cuda", dtype=torch.bfloat16)
    vis, depth = _tree(PARENTS)
    s0 = torch.tensor([start], device="cuda")
    pos = s0[:, None] + depth[None].cuda()
    anc, chain = tables.ancestor_map(s0, pos, vis.cuda())
    out = bia.attention(q, kc, vc, torch.tensor([0], device="cuda"), s0, pos, anc, chain, start + 64)
    one = torch.ones(1, 1, 1, dtype=torch.bool, device="cuda")
    for node in range(t):
        path = _path(PARENTS, node)
        _ar_layout(kc, vc, 0, 1, start, path)
        p = start + len(path) - 1
        pt = torch.tensor([p], device="cuda")
        a1, c1 = tables.ancestor_map(pt, pt[:, None], one)
        for kv_len in (p + 1, 1024 * (p // 1024 + 1), 4096):
            ar = bia.attention(q[:, :, node:node + 1], kc, vc, torch.tensor([1], device="cuda"), pt, pt[:, None],
                              a1, c1, kv_len)
            assert torch.equal(ar[0, :, 0], out[0, :, node]), f"node {node} at kv_len {kv_len}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [8, 9, 16])
def test_gpu_chain_row_equals_its_ar_decode(tokens):
    # a chain (a DFlash block, a prompt chunk) reads its keys in the shared loop, keys past a row's position loaded and
    # masked; 64-row programs failed this 1 row in 16 at some starts (chain of 16 at 64, of 9 at 63 and 100)
    kv, g, d = 8, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    one = torch.ones(1, 1, 1, dtype=torch.bool, device="cuda")
    # 250, 500, 1020: the chain crosses a split edge at a multiple of 256 or of rules.ATTN_SPLIT_KEYS
    for start in (63, 64, 100, 200, 250, 500, 1000, 1020, 3000):
        kc = torch.randn(2, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(2, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(1, kv * g, tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        s0 = torch.tensor([start], device="cuda")
        pos = s0[:, None] + torch.arange(tokens, device="cuda")[None]
        anc, chain = tables.ancestor_map(s0, pos, torch.tril(one.expand(1, tokens, tokens)))
        out = bia.attention(q, kc, vc, torch.tensor([1], device="cuda"), s0, pos, anc, chain, start + 64)
        for t in range(tokens):
            pt = pos[0, t:t + 1]
            a1, c1 = tables.ancestor_map(pt, pt[:, None], one)
            ar = bia.attention(q[:, :, t:t + 1], kc, vc, torch.tensor([1], device="cuda"), pt, pt[:, None], a1, c1,
                              start + t + 1)
            assert torch.equal(ar[0, :, 0], out[0, :, t]), f"row {t} of a chain at {start}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 12288)])  # o_proj and down: split count 4
def test_gpu_split_and_fused_launches_agree_at_every_row_count(shape):
    # split programs + the ordered sum kernel and fused programs walking the segments: the same bits for every row
    # at every row count 1..2048, whichever launch the table would pick
    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    ref = bim.linear(x, w, launch=bim.MATMUL_POINTER_WIDE_LAUNCH)
    launches = [launch for _, launch in bim.MATMUL_POINTER_LAUNCHES + bim.MATMUL_LAUNCHES] + [
        bim.MATMUL_WIDE_LAUNCH, bim.MATMUL_POINTER_WIDE_LAUNCH, bim.MATMUL_POINTER_WIDE_LAUNCH._replace(flat=False),
        bim.MATMUL_POINTER_WIDE_LAUNCH._replace(tma=True), bim.MATMUL_LAUNCHES[0][1]._replace(tma=True),
        bim.MatmulLaunch(128, 256, 8, 3, fused=True, flat=True)]
    assert {launch.fused for launch in launches} == {True, False}
    assert {(launch.tma, launch.fused) for launch in launches} == {(True, True), (True, False), (False, True),
                                                                  (False, False)}
    assert bim.tma_loads(x) and bim._descriptors_fit(x, w, ref)  # an H200: the descriptor launches run, no fallback
    for m in range(1, 2049):
        for launch in launches:
            assert torch.equal(bim.linear(x[:m], w, launch=launch), ref[:m]), f"{launch} at {m} rows"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 12288)])
def test_gpu_default_launches_with_whole_waves_keep_every_row(shape):
    # the engine's call (no launch given): past one wave of wide tiles the rows run as whole waves plus a rest;
    # every row at every row count across the waves' edges equal to the pointer wide launch's
    n, k = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    ref = bim.linear(x, w, launch=bim.MATMUL_POINTER_WIDE_LAUNCH)
    wave = bim.matmul_wave_rows(n, k, x.device)
    assert wave > 0
    assert any(bim._whole_waves(n, k, m, True, wave) for m in range(1, 2049))  # the split runs somewhere
    for m in range(1, 2049):
        assert torch.equal(bim.linear(x[:m], w), ref[:m]), f"default launch at {m} rows"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_descriptor_launches_with_a_bias_and_a_masked_k_tile():
    # K = 4064: the last of 64 K blocks is half past the end (descriptors pad it with zeros, pointers mask it), a
    # bias; every launch of both tables against the pointer wide launch at row counts across the tables' edges
    n, k = 4096, 4064
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    assert bim.matmul_tiles(n, k).split_k == 4
    ref = bim.linear(x, w, b, launch=bim.MATMUL_POINTER_WIDE_LAUNCH)
    launches = [launch for _, launch in bim.MATMUL_POINTER_LAUNCHES + bim.MATMUL_LAUNCHES] + [bim.MATMUL_WIDE_LAUNCH]
    for m in (1, 16, 17, 128, 129, 192, 193, 640, 641, 1024, 2048):
        for launch in launches:
            assert torch.equal(bim.linear(x[:m], w, b, launch=launch), ref[:m]), f"{launch} at {m} rows"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("parents", [None, PARENTS, WIDE[:9], WIDE[:17], WIDE],
                         ids=["chain of 16", "7 nodes", "9 nodes", "17 nodes (a 16-row last program)",
                              "20 nodes (three query tiles)"])
def test_gpu_fused_launch_gives_the_split_launch_bits(parents):
    # 64 rows at starts across split edges (a program's rows past different split counts), launched at the engine's
    # key-length bucket: the fused launch against stored partials and the combine kernel
    kv, g, d, rows = 8, 4, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    if parents is None:
        t = 16
        vis = torch.tril(torch.ones(1, t, t, dtype=torch.bool))
        depth = torch.arange(t)
    else:
        t = len(parents)
        vis, depth = _tree(parents)
    kc = torch.randn(rows + 1, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(rows, kv * g, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    start = torch.randint(0, 3000, (rows,), device="cuda", generator=gen)
    start[:4] = torch.tensor([250, 255, 1020, 0], device="cuda")
    pos = start[:, None] + depth[None].cuda()
    anc, chain = tables.ancestor_map(start, pos, vis.cuda().expand(rows, t, t).contiguous())
    args = (q, kc, vc, torch.arange(rows, device="cuda"), start, pos, anc, chain, 4096)
    split = bia.attention(*args, fused=False)
    assert torch.equal(bia.attention(*args, fused=True), split)
    assert torch.equal(bia.attention(*args, fused=True, num_stages=3), split)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nodes, rows", [(17, 1), (17, 64), (33, 8), (33, 64)])
def test_gpu_small_last_tiles_give_the_bits_of_full_ones(monkeypatch, rows, nodes):
    # the last query tile in a 16-row program (ATTN_SMALL_TAIL_ROWS) against full-size programs, both launches, the
    # tails grouped and a chunk per query, at the engine's key-length bucket
    kv, g, d = 8, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(nodes + rows)
    vis, depth = _tree((WIDE + tuple(range(14, 27)))[:nodes])
    kc = torch.randn(rows + 1, kv, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(rows, kv * g, nodes, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    start = torch.randint(0, 3000, (rows,), device="cuda", generator=gen)
    start[0] = 250
    pos = start[:, None] + depth[None].cuda()
    anc, chain = tables.ancestor_map(start, pos, vis.cuda().expand(rows, nodes, nodes).contiguous())
    args = (q, kc, vc, torch.arange(rows, device="cuda"), start, pos, anc, chain, 4096)
    monkeypatch.setattr(rules, "ATTN_SMALL_TAIL_ROWS", 0)
    ref = bia.attention(*args, fused=False)
    monkeypatch.setattr(rules, "ATTN_SMALL_TAIL_ROWS", 16)
    assert rules.attention_small_tail(nodes, g, rows * kv)
    for tail in (tables.tail_chunks(anc, pos, start, g, kv), tables.single_chunks(rows, nodes, g, q.device, kv)):
        for fused in (False, True):
            assert torch.equal(bia.attention(*args, fused=fused, tail=tail), ref), f"fused={fused}"
