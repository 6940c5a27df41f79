"""The Triton tree-attention kernel against dense masked attention and a plain-loop oracle, and the TargetModel
forward with ``tree=`` against the dense-mask forward.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; every test here
runs inside ``triton_runtime.cpu_interpreter()``), so shapes stay tiny: head_dim 64 (the smallest the kernel takes), a handful of rows and tens of keys, BLOCK_N 16 to get several
key blocks and context splits.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from model_helpers import random_target, rel_err  # noqa: E402

from ddtree import speculative, triton_runtime, tuning  # noqa: E402
from ddtree.errors import ConfigError, ShapeError  # noqa: E402
from ddtree.models import tree_attention as ta  # noqa: E402
from ddtree.models.layers import masked_attention  # noqa: E402
from ddtree.speculative.attention import TreeVisibility  # noqa: E402

if not torch.cuda.is_available() and not triton_runtime.INTERPRETED:
    pytest.skip("no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=1 must be set before import)",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def kernel_on(triton_kernels_on_cpu):
    """Let the kernel run on CPU tensors (interpreter) for every test here; a no-op for CUDA tensors."""
    yield


# ---- references ------------------------------------------------------------------------------------------------

def dense_reference(q, k_cache, v_cache, slots, start, new_vis, kv_len):
    """masked_attention over the gathered slots under build_attention_mask (the target's dense path)."""
    t = q.shape[2]
    mask = speculative.build_attention_mask(start, speculative.tree_write_positions(start, t), new_vis, kv_len)
    k_all = k_cache[slots, :, :kv_len].to(q.dtype)
    v_all = v_cache[slots, :, :kv_len].to(q.dtype)
    return masked_attention(q, k_all, v_all, mask[:, None])


def loop_reference(q, k_cache, v_cache, slots, start, new_vis, first=None):
    """The visibility rule written out per (row, head, query), softmax in float64; ``first`` [R] hides prefix keys
    below it."""
    r_count, h_count, t_count, d = q.shape
    group = h_count // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(r_count):
        s0 = int(start[r])
        f0 = 0 if first is None else int(first[r])
        for t in range(t_count):
            keys = list(range(f0, s0)) + [s0 + j for j in range(t_count) if bool(new_vis[r, t, j]) or j == t]
            for h in range(h_count):
                k = k_cache[int(slots[r]), h // group, keys].double()
                v = v_cache[int(slots[r]), h // group, keys].double()
                weights = torch.softmax(k @ q[r, h, t].double() / math.sqrt(d), dim=0)
                out[r, h, t] = weights @ v
    return out


# ---- inputs ------------------------------------------------------------------------------------------------------

def ancestor_visibility(parents: torch.Tensor) -> torch.Tensor:
    """parents [R, N] (root -1, parent < child) -> [R, N, N] bool: j is i or an ancestor of i."""
    r, n = parents.shape
    vis = torch.zeros(r, n, n, dtype=torch.bool)
    for row in range(r):
        for i in range(n):
            node = i
            while node >= 0:
                vis[row, i, node] = True
                node = int(parents[row, node])
    return vis


def random_parent_visibility(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    parents = torch.full((rows, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (rows,), generator=gen)
    return ancestor_visibility(parents)


def draft_tree_visibility(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Visibility of real DDTree trees built from random drafter logits (some nodes may stay invalid)."""
    logits = 3 * torch.randn(rows, 3, 6, generator=gen)
    trees = speculative.build_trees(logits, torch.randint(0, n, (rows,), generator=gen), max_budget=n - 1)
    return trees.visibility


def make_case(*, rows=3, heads=4, kv_heads=2, t=5, d=64, kv_len=40, max_len=48, vis="tree", dtype=torch.float32,
              seed=0):
    """Random cache, queries and visibility. Starts include 0 and kv_len - T; slots are shuffled, with the scratch
    slot (last) shared by two rows like padding rows of a bucket."""
    gen = torch.Generator().manual_seed(seed)
    slots_total = rows + 2
    k_cache = torch.randn(slots_total, kv_heads, max_len, d, generator=gen).to(dtype)
    v_cache = torch.randn(slots_total, kv_heads, max_len, d, generator=gen).to(dtype)
    q = (2 * torch.randn(rows, heads, t, d, generator=gen)).to(dtype)
    start = torch.randint(0, kv_len - t + 1, (rows,), generator=gen)
    start[0] = 0
    if rows > 1:
        start[1] = kv_len - t
    slots = torch.randperm(slots_total, generator=gen)[:rows]
    if rows > 2:
        slots[-2:] = slots_total - 1
    if vis == "tree":
        new_vis = draft_tree_visibility(rows, t, gen)
    elif vis == "parents":
        new_vis = random_parent_visibility(rows, t, gen)
    elif vis == "causal":
        new_vis = speculative.causal_visibility(t, torch.randint(1, t + 1, (rows,), generator=gen))
    else:  # any boolean pattern, not even a tree: the rule must hold for it too
        new_vis = torch.rand(rows, t, t, generator=gen) < 0.5
    to = dict(device=DEVICE)
    return dict(q=q.to(**to), k_cache=k_cache.to(**to), v_cache=v_cache.to(**to), slots=slots.to(**to),
                start=start.to(**to), new_vis=new_vis.to(**to), kv_len=kv_len)


# ---- kernel vs references ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("vis", ["tree", "parents", "causal", "any"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2)])
def test_matches_dense_fp32(vis, heads, kv_heads):
    case = make_case(heads=heads, kv_heads=kv_heads, vis=vis, seed=len(vis) * heads)
    got = ta.tree_attention(**case, block_n=16, splits=2)
    ref = dense_reference(**case)
    assert got.dtype == torch.float32 and got.shape == case["q"].shape
    assert (got - ref).abs().max().item() < TOL[torch.float32]


def test_matches_plain_loop_oracle():
    case = make_case(rows=2, heads=4, kv_heads=1, t=4, kv_len=24, max_len=24, vis="parents", seed=7)
    got = ta.tree_attention(**case, block_n=16, splits=3)
    ref = loop_reference(case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(), case["slots"].cpu(),
                         case["start"].cpu(), case["new_vis"].cpu())
    assert (got.cpu().double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 32, None])
@pytest.mark.parametrize("block_n", [16, 32])
def test_split_counts_agree(splits, block_n):
    """More splits than a short row has key blocks leave empty splits; the combine must weigh them zero."""
    case = make_case(rows=3, heads=4, kv_heads=1, t=3, kv_len=45, max_len=45, vis="tree", seed=11)
    got = ta.tree_attention(**case, block_n=block_n, splits=splits)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


def test_max_splits_each_with_keys_to_read():
    """MAX_SPLITS splits that all get prefix blocks (38 blocks of 16 keys): the combine merges 33 partials."""
    case = make_case(rows=2, heads=4, kv_heads=2, t=3, kv_len=610, max_len=610, vis="tree", seed=17)
    got = ta.tree_attention(**case, block_n=16, splits=ta.MAX_SPLITS)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_pack_visibility_matches_a_bit_by_bit_oracle(t):
    """Every bit (the sign bit of each word included) and each query's last visible key, against plain Python."""
    gen = torch.Generator().manual_seed(t)
    new_vis = torch.rand(2, t, t, generator=gen) < 0.3
    packed = ta.pack_visibility(new_vis)
    assert packed.bits.shape == (2, t, -(-t // 64)) and packed.bits.dtype == torch.int64
    for r in range(2):
        for i in range(t):
            seen = [j for j in range(t) if bool(new_vis[r, i, j]) or j == i]
            words = [sum(1 << (j % 64) for j in seen if j // 64 == w) for w in range(-(-t // 64))]
            stored = [int(x) & (2**64 - 1) for x in packed.bits[r, i]]  # two's complement -> unsigned
            assert stored == words
            assert int(packed.last[r, i]) == max(seen)


@pytest.mark.parametrize("vis", ["parents", "any"])
@pytest.mark.parametrize("splits,block_n", [(1, 16), (3, 16), (2, 64), (1, 128)])
def test_trees_wider_than_one_visibility_word(vis, splits, block_n):
    """T = 70 > 64: the new keys span two packed words, in tiles of 16 (four per word) or 64 (one word each; also
    for 128-key prefix tiles); row tiles whose queries see only early keys stop early (lower-triangular
    ``parents``), ``any`` makes every tile visit all of them."""
    case = make_case(rows=2, heads=2, kv_heads=2, t=70, kv_len=100, max_len=100, vis=vis, seed=23)
    got = ta.tree_attention(**case, block_n=block_n, block_m=32, splits=splits)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


def test_packed_visibility_of_another_shape_is_rejected():
    case = make_case(rows=1, t=3, kv_len=10, max_len=10, seed=2)
    with pytest.raises(ShapeError, match="packed visibility"):
        ta.tree_attention(**case, packed=ta.pack_visibility(case["new_vis"][:, :2, :2]))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_matches_dense_bf16(heads, kv_heads):
    case = make_case(heads=heads, kv_heads=kv_heads, dtype=torch.bfloat16, seed=3)
    got = ta.tree_attention(**case, block_n=16, splits=3)
    ref = dense_reference(**{**case, "q": case["q"].float(), "k_cache": case["k_cache"].float(),
                             "v_cache": case["v_cache"].float()})
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max().item() < TOL[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.parametrize("splits", [1, 4])
def test_plain_decoding_single_token(splits):
    """T = 1 (AR rows and the root-only trees of a DFlash-less round): the query sees the prefix and itself."""
    case = make_case(rows=4, heads=8, kv_heads=2, t=1, kv_len=37, max_len=40, vis="tree", seed=5)
    got = ta.tree_attention(**case, block_n=16, splits=splits)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("splits", [1, 3])
def test_first_hides_the_prefix_below_it(splits):
    """``first`` (a drafter's window): prefix keys below it are invisible; at a block boundary, inside a block,
    inside the new tokens' block, equal to start (no prefix at all) and 0 (no effect)."""
    case = make_case(rows=6, heads=4, kv_heads=2, t=4, kv_len=70, max_len=72, vis="tree", seed=21)
    start = torch.tensor([0, 66, 40, 35, 50, 20])
    case["start"] = start.to(DEVICE)
    first = torch.tensor([0, 17, 32, 35, 49, 0])  # row 3: first == start; row 4: same block as start
    got = ta.tree_attention(**case, first=first.to(DEVICE), block_n=16, splits=splits)
    ref = loop_reference(case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(), case["slots"].cpu(), start,
                         case["new_vis"].cpu(), first)
    assert (got.cpu().double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_prefix_edges_on_and_off_block_boundaries_count_every_key_once(splits):
    """``first`` and ``start`` on, just before and just after 16-key block boundaries, with zero, one and several
    whole blocks between them, and splits whose shares end mid-prefix: each visible key counted exactly once."""
    pairs = [(0, 16), (0, 17), (1, 31), (15, 32), (16, 47), (17, 48), (0, 64), (33, 64), (47, 49), (5, 5),
             (1, 48), (0, 80), (31, 81)]
    first = torch.tensor([f for f, _ in pairs])
    start = torch.tensor([s for _, s in pairs])
    case = make_case(rows=len(pairs), heads=4, kv_heads=2, t=3, kv_len=84, max_len=84, vis="tree", seed=5)
    case["start"] = start.to(DEVICE)
    got = ta.tree_attention(**case, first=first.to(DEVICE), block_n=16, splits=splits)
    ref = loop_reference(case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(), case["slots"].cpu(), start,
                         case["new_vis"].cpu(), first)
    assert (got.cpu().double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_row_tile_sizes_agree(block_m):
    """block_m (folded query rows per program, a tuning knob): more or fewer row tiles, the same attention."""
    case = make_case(rows=2, heads=8, kv_heads=2, t=9, kv_len=40, max_len=40, vis="tree", seed=13)
    got = ta.tree_attention(**case, block_n=16, splits=2, block_m=block_m)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("combine_block_m, combine_block_d", [(16, 32), (32, 32), (16, 16), (64, 16)])
def test_combine_tiles_give_the_same_bits(combine_block_m, combine_block_d):
    """The combine's tile (rows x head-dim columns per program, ``ddtree.tuning.choose_combine_tile``): each
    element's merge of its partials is the same arithmetic in the same order whatever the tile, so the output is
    identical bit for bit to the combine over the split's whole 64-row tile and all 32 columns; a tile that is not
    a power of two in [16, block_m] x [16, head_dim] is named."""
    case = make_case(rows=2, heads=8, kv_heads=2, t=9, kv_len=40, max_len=40, vis="tree", seed=21)
    wide = ta.tree_attention(**case, block_n=16, splits=3, block_m=64, combine_block_m=64, combine_block_d=64)
    narrow = ta.tree_attention(**case, block_n=16, splits=3, block_m=64, combine_block_m=combine_block_m,
                               combine_block_d=combine_block_d)
    assert torch.equal(wide, narrow)
    assert (narrow - dense_reference(**case)).abs().max().item() < TOL[torch.float32]
    launch = ta.plan_launch(2, 8, 2, 9, 32, 40, 4, 132, block_n=16, splits=3, block_m=64,
                            combine_block_m=combine_block_m, combine_block_d=combine_block_d)
    assert (launch.combine_block_m, launch.combine_block_d) == (combine_block_m, combine_block_d)
    # what the warm-up compiles
    assert ta.variants(launch, 9, 32, has_first=False)[1][2:4] == (combine_block_m, combine_block_d)
    for bad in (8, 24, 128):
        with pytest.raises(ConfigError, match="combine_block_m must be a power of two in \\[16, block_m = 64\\]"):
            ta.tree_attention(**case, block_n=16, splits=3, block_m=64, combine_block_m=bad)
    for bad in (8, 24, 128):
        with pytest.raises(ConfigError, match="combine_block_d must be a power of two in \\[16, head_dim = 64\\]"):
            ta.tree_attention(**case, block_n=16, splits=3, block_m=64, combine_block_d=bad)


def test_combine_tile_rule_against_brute_force(monkeypatch):
    """choose_combine_tile against every power-of-two tile: the widest (then tallest) one whose elements per thread
    times the unrolled partials fit the register budget, 16 x 16 where none does; the launch plan uses it where
    ``tuning.COMBINE_BLOCK_M``/``_D`` are None, their values otherwise (rows capped at the split's tile)."""
    from ddtree import tuning

    per_thread = 32 * tuning.COMBINE_WARPS
    for block_m, unroll, head_dim in itertools.product((16, 32, 64, 128), (3, 5, 9, 17, 33), (32, 64, 128, 256)):
        tiles = [(m, d) for m in (16, 32, 64, 128) for d in (16, 32, 64) if m <= min(block_m, 64) and d <= head_dim]
        fits = [(d, m) for m, d in tiles if m * d * unroll <= tuning.COMBINE_REGISTER_ELEMS * per_thread]
        want = (16, 16) if not fits else tuple(reversed(max(fits)))
        assert tuning.choose_combine_tile(block_m, unroll, head_dim) == want, (block_m, unroll, head_dim)
    # by default (both overrides None) the engine's shapes (1 row, 32 heads over 8, T = 16 at 4k: 16 splits, 17
    # partials) get the rule's tile, without spills; set, the overrides give the tile used before the rule (the
    # split's rows, 64 columns)
    rule = ta.plan_launch(1, 32, 8, 16, 128, 4096, 2, 132)
    assert rule.combine_splits == 17 and (rule.combine_block_m, rule.combine_block_d) == (16, 16)
    assert ta.variants(rule, 16, 128, has_first=False)[1][2:4] == (16, 16)
    monkeypatch.setattr(tuning, "COMBINE_BLOCK_M", 128)
    monkeypatch.setattr(tuning, "COMBINE_BLOCK_D", 64)
    old = ta.plan_launch(1, 32, 8, 16, 128, 4096, 2, 132)
    assert (old.combine_block_m, old.combine_block_d) == (old.block_m, 64)


def test_head_dim_256_and_many_folded_rows():
    """D = 256 and G * T = 72 folded rows: two row tiles of 64."""
    case = make_case(rows=1, heads=8, kv_heads=1, t=9, d=256, kv_len=20, max_len=20, vis="tree", seed=9)
    got = ta.tree_attention(**case, block_n=16, splits=2)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


def test_never_reads_past_the_new_tokens_and_writes_every_output(monkeypatch):
    """Cache entries at or past start + T are NaN (never visible, so never loaded), and every buffer the kernel
    allocates starts NaN-filled: an output element or a split partial left unwritten would show up."""
    case = make_case(rows=3, heads=4, kv_heads=2, t=4, kv_len=40, max_len=48, vis="tree", seed=13)
    ref = dense_reference(**case)
    for slot in case["slots"].unique().tolist():
        end = int((case["start"] + 4)[case["slots"] == slot].max())  # rows sharing the scratch slot: the furthest
        case["k_cache"][slot, :, end:] = float("nan")
        case["v_cache"][slot, :, end:] = float("nan")

    real_empty = torch.empty

    def nan_empty(*shape, **kwargs):
        out = real_empty(*shape, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(ta.torch, "empty", nan_empty)
    monkeypatch.setattr(ta.torch, "empty_like", lambda t, **kw: nan_empty(t.shape, dtype=t.dtype, device=t.device))
    for splits in (1, 5):
        got = ta.tree_attention(**case, block_n=16, splits=splits)
        assert torch.isfinite(got).all()
        assert (got - ref).abs().max().item() < TOL[torch.float32]


def test_strided_slots_start_and_first():
    """slots, start and first as views with a stride (columns of a packed buffer): each row must still read its own
    entry, not a neighbour's."""
    case = make_case(rows=3, heads=4, kv_heads=2, t=4, kv_len=40, max_len=48, vis="tree", seed=29)
    first = (case["start"] // 2).clamp(max=case["start"])
    packed = torch.stack([case["slots"], case["start"], first, torch.zeros_like(first)], 1)  # [R, 4]
    got = ta.tree_attention(**{**case, "slots": packed[:, 0], "start": packed[:, 1]}, first=packed[:, 2],
                            block_n=16, splits=2)
    ref = loop_reference(case["q"].cpu(), case["k_cache"].cpu(), case["v_cache"].cpu(), case["slots"].cpu(),
                         case["start"].cpu(), case["new_vis"].cpu(), first=first.cpu())
    assert (got.cpu().double() - ref).abs().max().item() < TOL[torch.float32]


def test_non_contiguous_queries():
    """The layers hand over q as a transposed view ([R, T, H, D] -> [R, H, T, D])."""
    case = make_case(rows=2, heads=4, kv_heads=2, t=3, kv_len=30, max_len=30, seed=17)
    q_view = case["q"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_view.is_contiguous()
    got = ta.tree_attention(**{**case, "q": q_view}, block_n=16, splits=2)
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


# ---- configuration -----------------------------------------------------------------------------------------------

def test_rejects_unsupported_shapes():
    case = make_case(rows=1, d=64, kv_len=10, max_len=10, seed=1)
    with pytest.raises(ShapeError, match="head_dim"):
        ta.tree_attention(**{**case, "q": case["q"][..., :48], "k_cache": case["k_cache"][..., :48],
                             "v_cache": case["v_cache"][..., :48]})
    with pytest.raises(ShapeError, match="new_vis"):
        ta.tree_attention(**{**case, "new_vis": case["new_vis"][:, :2]})
    with pytest.raises(ShapeError, match="kv_len"):
        ta.tree_attention(**{**case, "kv_len": 11})
    with pytest.raises(ConfigError, match="block_n"):
        ta.tree_attention(**case, block_n=8)
    with pytest.raises(ConfigError, match="block_m"):
        ta.tree_attention(**case, block_m=24)


def test_target_supports_tree_attention_where_the_kernel_can_run():
    model = random_target(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=1).to(DEVICE)
    assert model.supports_tree_attention()
    with triton_runtime.cpu_interpreter(False):  # on CPU only the explicit test context enables it
        assert model.supports_tree_attention() == (DEVICE == "cuda")


@pytest.mark.parametrize("kv_len", [256, 1024, 2048, 4096, 8192, 32768])
def test_splits_at_batch_one_are_as_many_as_the_context_allows(kv_len):
    """Qwen3-8B decoding at batch 1 (8 KV heads x 1 row tile): split the keys towards ~2 programs per SM, but never
    below MIN_BLOCKS_PER_SPLIT key blocks per split nor above AUTO_MAX_SPLITS."""
    splits = tuning.choose_splits(row_programs=8, kv_len=kv_len, block_n=64, sm_count=132)
    blocks = kv_len // 64
    assert splits == min(max(1, blocks // tuning.MIN_BLOCKS_PER_SPLIT), tuning.AUTO_MAX_SPLITS, 33)
    assert splits * tuning.MIN_BLOCKS_PER_SPLIT <= max(blocks, tuning.MIN_BLOCKS_PER_SPLIT)


@pytest.mark.parametrize("requests,t,kv_len,d", [(1, 1, 1024, 128), (1, 17, 2048, 128), (1, 129, 1024, 128),
                                                  (1, 65, 8192, 128), (64, 9, 1024, 128), (1, 17, 1024, 256)])
def test_chosen_tiles_are_launchable(requests, t, kv_len, d):
    """Whatever the regime, the automatic tiles are ones the kernel accepts (and 32-key tiles for D = 256)."""
    tiles = tuning.choose_tiles(requests, 4 * t, kv_len, d)
    assert tiles.block_m >= 16 and tiles.block_m & (tiles.block_m - 1) == 0
    assert tiles.block_n in ta.SUPPORTED_BLOCK_N and (d <= 128 or tiles.block_n == 32)
    assert tiles.num_stages >= 2 and tiles.min_blocks_per_split >= 1
    # fp32 keeps the untuned tiles (64 rows, 64 keys, two stages): the tuned ones overflow shared memory
    wide = tuning.choose_tiles(requests, 4 * t, kv_len, d, elem_bytes=4)
    assert wide.block_m <= 64 and wide.block_n <= 64 and wide.num_stages == 2


def test_output_is_laid_out_for_the_output_projection():
    """[R, H, T, D] over [R, T, H, D] memory: transpose(1, 2).flatten(-2) is a view, no copy."""
    case = make_case(rows=2, heads=4, kv_heads=2, t=3, kv_len=30, max_len=30, seed=4)
    out = ta.tree_attention(**case, block_n=16)
    assert out.transpose(1, 2).is_contiguous()


def test_large_batches_do_not_split():
    assert tuning.choose_splits(row_programs=64 * 8 * 3, kv_len=4096, block_n=64, sm_count=132) == 1


@pytest.mark.parametrize("row_programs,kv_len,splits", [
    (72, 8192, 8),  # one request, T = 129: 9 row tiles x 8 KV heads (2 waves would be 4 splits)
    (40, 4096, 8),  # one request, T = 65 at exactly LONG_CONTEXT keys (7 without the floor)
    (64, 8192, 8),  # 8 requests of T = 9 (5 without it)
    (132, 8192, 8),  # one row program per SM: still floored
    (133, 8192, 2),  # more row programs than SMs: the waves alone
    (64, 4095, 5),  # below LONG_CONTEXT: the waves alone
])
def test_long_contexts_split_at_least_eight_ways_while_row_programs_leave_sms_idle(row_programs, kv_len, splits):
    assert tuning.choose_splits(row_programs=row_programs, kv_len=kv_len, block_n=64, sm_count=132,
                            multi_token=True) == splits


def test_plain_decoding_keeps_the_waves_split_count():
    """One new token a row lost with the floor on the H200 (run 28), so it keeps the waves' count."""
    assert tuning.choose_splits(row_programs=64, kv_len=8192, block_n=64, sm_count=132) == 5
    assert tuning.choose_splits(row_programs=64, kv_len=8192, block_n=64, sm_count=132, multi_token=False) == 5


@pytest.mark.parametrize("t,multi", [(1, False), (3, True)])
def test_tree_attention_floors_the_splits_of_multi_token_calls_only(monkeypatch, t, multi):
    """tree_attention tells choose_splits whether the call has several new tokens a row (T > 1)."""
    seen = []
    real = ta.choose_splits

    def spy(*args, **kwargs):
        seen.append(kwargs.get("multi_token"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ta, "choose_splits", spy)
    case = make_case(rows=1, heads=4, kv_heads=2, t=t, kv_len=40, max_len=40, vis="causal", seed=3)
    got = ta.tree_attention(**case)
    assert seen == [multi]
    assert (got - dense_reference(**case)).abs().max().item() < TOL[torch.float32]


def _verify_pair(model, cache, prompt_len: int, start: torch.Tensor, new_vis: torch.Tensor, kv_len: int):
    """Prefill rows to ``start`` through the dense path, then return the tree's (ids, positions, write_pos)."""
    rows, n = new_vis.shape[:2]
    gen = torch.Generator().manual_seed(21)
    slots = torch.arange(rows)
    prompt = torch.randint(0, model.config.vocab_size, (rows, prompt_len), generator=gen)
    pos = torch.arange(prompt_len).expand(rows, -1)
    model(prompt, pos, cache, slots, pos, speculative.build_attention_mask(torch.zeros(rows, dtype=torch.long), pos,
                                                                     speculative.causal_visibility(prompt_len, start),
                                                                     kv_len))
    ids = torch.randint(0, model.config.vocab_size, (rows, n), generator=gen)
    depths = new_vis.sum(-1) - 1
    return slots, ids, speculative.tree_positions(start, depths), speculative.tree_write_positions(start, n)


def count_kernel_calls(monkeypatch) -> list[int]:
    """Wrap ta.tree_attention (what the target's attention calls) so a test can tell which path ran."""
    calls = []
    real = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_target_forward_with_tree_equals_dense_mask(monkeypatch):
    model = random_target(head_dim=64, num_heads=8, num_kv_heads=2, num_layers=2)
    if not triton_runtime.INTERPRETED:
        pytest.skip("CPU model: the compiled kernel runs only on CUDA (the GPU tests below cover it there)")
    assert model.supports_tree_attention()
    start, kv_len, n = torch.tensor([9, 4]), 24, 6
    new_vis = random_parent_visibility(2, n, torch.Generator().manual_seed(2))
    dense_cache, kernel_cache = model.allocate_cache(3, 32), model.allocate_cache(3, 32)
    slots, ids, positions, write_pos = _verify_pair(model, dense_cache, 9, start, new_vis, kv_len)
    kernel_cache.k.copy_(dense_cache.k)
    kernel_cache.v.copy_(dense_cache.v)

    mask = speculative.build_attention_mask(start, write_pos, new_vis, kv_len)
    calls = count_kernel_calls(monkeypatch)
    dense = model(ids, positions, dense_cache, slots, write_pos, mask, hidden_layers=(0, 1))
    assert calls == []  # a mask given: the dense path
    tree = model(ids, positions, kernel_cache, slots, write_pos, TreeVisibility(start, new_vis, kv_len),
                 hidden_layers=(0, 1))
    assert len(calls) == 2  # one kernel call per layer
    assert rel_err(tree.logits, dense.logits) < 1e-5
    assert rel_err(tree.hidden, dense.hidden) < 1e-5
    # layer 0 writes identical K/V; deeper layers' differ by the attention's rounding
    assert torch.equal(kernel_cache.k[0], dense_cache.k[0])
    assert rel_err(kernel_cache.k, dense_cache.k) < 1e-5 and rel_err(kernel_cache.v, dense_cache.v) < 1e-5


def test_chunked_prefill_through_the_kernel_equals_the_dense_path():
    """ModelRunner.prefill with the kernel (a causal chunk as a tree) against the dense mask: two chunks, the second
    continuing two rows at different starts beside a new row, ragged valid lengths. Logits and every committed
    cache entry must agree."""
    from ddtree.engine import EngineConfig
    from ddtree.engine.kernels import KernelSet
    from ddtree.engine.runner import ModelRunner, PrefillInputs

    target = random_target(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=2).to(DEVICE)
    runs = {}
    for kernels in (False, True):
        runner = ModelRunner(target, None, slots=3, cache_len=40,
                             kernels=KernelSet.resolve(EngineConfig(gpu_kernels=kernels), target, None))
        assert runner.tree_kernel == kernels
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, target.config.vocab_size, (2, 7), generator=gen).to(DEVICE)
        first = runner.prefill(PrefillInputs(ids, *(torch.tensor(x, device=DEVICE) for x in
                                                    ([2, 0], [0, 0], [3, 7], [2, 6])), kv_len=7))
        ids = torch.randint(0, target.config.vocab_size, (3, 9), generator=gen).to(DEVICE)
        second = runner.prefill(PrefillInputs(ids, *(torch.tensor(x, device=DEVICE) for x in
                                                     ([2, 0, 1], [3, 7, 0], [9, 2, 5], [8, 1, 4])), kv_len=16))
        runs[kernels] = (first, second, runner.target_cache.k.clone(), runner.target_cache.v.clone())
    dense, kernel = runs[False], runs[True]
    assert (dense[0] - kernel[0]).abs().max().item() < 1e-4
    assert (dense[1] - kernel[1]).abs().max().item() < 1e-4
    for slot, committed in ((2, 12), (0, 9), (1, 5)):
        for which in (2, 3):
            diff = dense[which][:, slot, :, :committed] - kernel[which][:, slot, :, :committed]
            assert diff.abs().max().item() < 1e-5


def test_target_forward_with_tree_builds_the_mask_when_the_kernel_cannot_run(monkeypatch):
    model = random_target(head_dim=64, num_heads=4, num_kv_heads=2, num_layers=1)  # CPU weights
    start, kv_len, n = torch.tensor([5]), 12, 4
    new_vis = random_parent_visibility(1, n, torch.Generator().manual_seed(4))
    cache = model.allocate_cache(1, 16)
    slots, ids, positions, write_pos = _verify_pair(model, cache, 5, start, new_vis, kv_len)
    mask = speculative.build_attention_mask(start, write_pos, new_vis, kv_len)
    dense = model(ids, positions, cache, slots, write_pos, mask)
    calls = count_kernel_calls(monkeypatch)
    with triton_runtime.cpu_interpreter(False):
        assert not model.supports_tree_attention()
        tree = model(ids, positions, cache, slots, write_pos, TreeVisibility(start, new_vis, kv_len))
    assert calls == []
    assert torch.equal(tree.logits, dense.logits)
    with pytest.raises(ShapeError, match="a dense mask tensor or a TreeVisibility"):
        model(ids, positions, cache, slots, write_pos, None)


def test_target_head_dims_the_kernel_lacks_use_the_dense_path():
    model = random_target().to(DEVICE)  # head_dim 8
    assert triton_runtime.can_run(model.embed_tokens.weight)
    assert not model.supports_tree_attention()


# ---- CUDA only: benchmark shapes and graph capture -----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows,t,kv_len", [(1, 1, 4096), (1, 33, 4096), (8, 33, 4096), (1, 33, 1024),
                                           (1, 129, 1024), (1, 129, 8192)])
def test_cuda_qwen3_8b_shapes(rows, t, kv_len):
    """Qwen3-8B attention (32 heads, 8 KV heads, D = 128, bf16) with automatic tiles and splits in every regime of
    choose_tiles: one request at a short context (16-row tiles; 128 x 128 tiles with 8 warps past 128 folded
    rows), long contexts (three stages), several requests."""
    case = make_case(rows=rows, heads=32, kv_heads=8, t=t, d=128, kv_len=kv_len, max_len=kv_len,
                     dtype=torch.bfloat16, seed=rows + t)
    got = ta.tree_attention(**case)
    ref = dense_reference(**case)
    assert (got.float() - ref.float()).abs().max().item() < TOL[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """Captured once, replayed after the inputs change in place (new starts and trees): no host sync inside."""
    case = make_case(rows=4, heads=32, kv_heads=8, t=17, d=128, kv_len=1024, max_len=1024, dtype=torch.bfloat16)
    ta.tree_attention(**case)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ta.tree_attention(**case)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.tree_attention(**case)
    other = make_case(rows=4, heads=32, kv_heads=8, t=17, d=128, kv_len=1024, max_len=1024, dtype=torch.bfloat16,
                      seed=99)
    for name in ("q", "k_cache", "v_cache", "slots", "start", "new_vis"):
        case[name].copy_(other[name])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ta.tree_attention(**other))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_write_kv_matches_the_cache_write(dtype, t):
    """The one-kernel K/V store equals KVCache.write (the reference) bit for bit, for non-contiguous inputs too
    (the layers hand over transposed views), and touches nothing else."""
    from ddtree.models.kv_cache import KVCache

    gen = torch.Generator().manual_seed(t)
    rows, kv_heads, d, max_len = 3, 2, 64, 24
    ref = KVCache.allocate(1, rows + 1, kv_heads, max_len, d, dtype=dtype, device=DEVICE)
    ref.k.copy_(torch.randn(ref.k.shape, generator=gen).to(dtype))
    ref.v.copy_(torch.randn(ref.v.shape, generator=gen).to(dtype))
    k_cache, v_cache = ref.k[0].clone(), ref.v[0].clone()
    k = torch.randn(rows, t, kv_heads, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)  # [R, KV, T, D] view
    v = torch.randn(rows, t, kv_heads, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    slots = torch.tensor([2, 0, 3], device=DEVICE)
    write_pos = (torch.tensor([[0], [7], [max_len - t]]) + torch.arange(t)).to(DEVICE)
    ta.write_kv(k_cache, v_cache, slots, write_pos, k, v)
    ref.write(0, slots, write_pos, k, v)
    assert torch.equal(k_cache, ref.k[0]) and torch.equal(v_cache, ref.v[0])


def test_write_kv_rejects_mismatched_shapes():
    cache = torch.zeros(2, 2, 8, 64, device=DEVICE)
    k = torch.zeros(1, 2, 1, 64, device=DEVICE)
    with pytest.raises(ShapeError, match="write_kv"):
        ta.write_kv(cache, cache, torch.zeros(1, dtype=torch.long, device=DEVICE),
                    torch.zeros(1, 2, dtype=torch.long, device=DEVICE), k, k)
    with pytest.raises(ShapeError, match="head_dim"):
        small = torch.zeros(2, 2, 8, 48, device=DEVICE)
        ta.write_kv(small, small, torch.zeros(1, dtype=torch.long, device=DEVICE),
                    torch.zeros(1, 1, dtype=torch.long, device=DEVICE), k[..., :48], k[..., :48])
