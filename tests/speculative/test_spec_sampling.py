"""Sampling: walked tokens follow the target's distribution (chi-square), draws are seeded per request."""

from __future__ import annotations

import math

import pytest
import torch

from ddtree.errors import ShapeError
from ddtree.speculative import build_trees, counter_uniform, sample_choices, walk_trees
from ddtree.speculative.sampling import BLOCK

VOCAB, DEPTHS, BUDGET, TOKENS = 3, 2, 4, 3
BASE = VOCAB + 1  # prefix codes: bijective base-(V+1) numbers, digit = token + 1


def _filtered_probs(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """The target distribution one token at a time, written as plain loops (HF order: T, top-k, top-p)."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda t: (logits[t], -t))
        return [1.0 if t == best else 0.0 for t in range(len(logits))]
    order = sorted(range(len(logits)), key=lambda t: (-logits[t], t))
    keep = order[:top_k] if top_k > 0 else order
    weights = {t: math.exp(logits[t] / temperature) for t in keep}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for t in keep:
        if top_p < 1 and mass >= top_p:
            break
        kept.append(t)
        mass += weights[t] / total
    norm = sum(weights[t] for t in kept)
    return [weights[t] / norm if t in kept else 0.0 for t in range(len(logits))]


def _generate(table: torch.Tensor, settings: list[tuple[float, float, int]], per_setting: int, draft_seed: int,
              *, node_steps: bool = False, budget: int = BUDGET):
    """Decode TOKENS tokens for many requests by tree rounds; the target's logits are table[prefix code].

    node_steps: key each node's draw by its output index (count + depth, a [R, N] step) instead of the round's
    [R] counter. budget 0 decodes plainly (root-only trees, one token per round).
    """
    rows = per_setting * len(settings)
    temperature = torch.tensor([s[0] for s in settings]).repeat_interleave(per_setting)
    top_p = torch.tensor([s[1] for s in settings]).repeat_interleave(per_setting)
    top_k = torch.tensor([s[2] for s in settings]).repeat_interleave(per_setting)
    seed = torch.arange(rows) * 7919 + 13
    out = torch.zeros(rows, TOKENS, dtype=torch.long)
    count = torch.zeros(rows, dtype=torch.long)
    code = torch.zeros(rows, dtype=torch.long)  # the committed sequence's code
    gen = torch.Generator().manual_seed(draft_seed)
    for _ in range(TOKENS):  # every round commits at least one token
        trees = build_trees(2 * torch.randn(rows, DEPTHS, VOCAB, generator=gen), budget)
        node_code = code.unsqueeze(1).repeat(1, budget + 1)
        for _ in range(DEPTHS):  # the test's own loop: code(child) = code(parent) * BASE + token + 1
            parent_code = torch.gather(node_code, 1, trees.parents.clamp(min=0))
            node_code = torch.where(trees.parents >= 0, parent_code * BASE + trees.tokens + 1, node_code)
        logits = table[node_code % table.shape[0]]  # [R, N, V]; only codes of length <= TOKENS matter
        step = count.unsqueeze(1) + trees.depths if node_steps else count
        choices = sample_choices(logits, temperature, top_p, top_k, seed, step)
        walk = walk_trees(trees, choices, DEPTHS)
        for j in range(DEPTHS + 1):
            take = (j < walk.num_accepted) & (count + j < TOKENS)
            out[take, (count + j)[take]] = walk.new_tokens[take, j]
            code = torch.where(take, code * BASE + walk.new_tokens[:, j] + 1, code)
        count = count + walk.num_accepted
    assert bool((count >= TOKENS).all())
    return out


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    cells = expected > 0
    assert int(observed[~cells].sum()) == 0, "a zero-probability sequence was produced"
    stat = float((((observed - expected) ** 2)[cells] / expected[cells]).sum())
    dof = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _expected_counts(table: torch.Tensor, setting: tuple[float, float, int], n: int) -> torch.Tensor:
    probs = torch.zeros(VOCAB**TOKENS, dtype=torch.float64)
    for cell in range(VOCAB**TOKENS):
        tokens = [cell // VOCAB ** (TOKENS - 1 - k) % VOCAB for k in range(TOKENS)]
        p, code = 1.0, 0
        for t in tokens:
            p *= _filtered_probs(table[code].tolist(), *setting)[t]
            code = code * BASE + t + 1
        probs[cell] = p
    return probs * n


SETTINGS = [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.5, 1.0, 2), (0.9, 0.6, 2)]


def _table() -> torch.Tensor:
    return 1.5 * torch.randn(BASE ** (TOKENS + 1), VOCAB, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("node_steps", [False, True], ids=["round-step", "node-step"])
def test_walked_tokens_follow_the_target_distribution(node_steps: bool) -> None:
    table, per_setting = _table(), 6000
    tokens = _generate(table, SETTINGS, per_setting, draft_seed=1, node_steps=node_steps)
    cells = tokens[:, 0] * VOCAB**2 + tokens[:, 1] * VOCAB + tokens[:, 2]
    for i, setting in enumerate(SETTINGS):
        observed = torch.bincount(cells[i * per_setting : (i + 1) * per_setting], minlength=VOCAB**TOKENS)
        p = _chi_square_p(observed.double(), _expected_counts(table, setting, per_setting))
        assert p > 1e-3, (setting, p)


def test_node_steps_make_tree_and_plain_decoding_identical() -> None:
    """Keyed by output index, a seeded request gets the same tokens from any tree as from plain decoding."""
    table = _table()
    plain = _generate(table, SETTINGS, 300, draft_seed=1, node_steps=True, budget=0)
    for draft_seed in (1, 2):
        assert torch.equal(_generate(table, SETTINGS, 300, draft_seed=draft_seed, node_steps=True), plain)
    # The round-step keying does depend on the rounds: same distribution, different individual draws.
    assert not torch.equal(_generate(table, SETTINGS, 300, draft_seed=1), plain)


def test_chi_square_detects_a_wrong_distribution() -> None:
    """The check has power: tokens sampled at temperature 1.0 fail against the temperature-0.7 distribution."""
    table, per_setting = _table(), 6000
    tokens = _generate(table, [(1.0, 1.0, 0)], per_setting, draft_seed=1)
    cells = tokens[:, 0] * VOCAB**2 + tokens[:, 1] * VOCAB + tokens[:, 2]
    observed = torch.bincount(cells, minlength=VOCAB**TOKENS).double()
    assert _chi_square_p(observed, _expected_counts(table, (0.7, 1.0, 0), per_setting)) < 1e-6


def test_greedy_rows_take_the_argmax_and_filters_remove_tokens() -> None:
    logits = torch.tensor([[[1.0, 3.0, 2.0, 0.0]], [[1.0, 3.0, 2.0, 0.0]], [[0.0, 0.0, 5.0, 0.0]]]).repeat(1, 50, 1)
    rows = 3
    temperature, top_p, top_k = torch.tensor([0.0, 5.0, 1.0]), torch.tensor([1.0, 1.0, 0.5]), torch.tensor([0, 2, 0])
    got = sample_choices(logits, temperature, top_p, top_k, torch.arange(rows), torch.zeros(rows, dtype=torch.long))
    assert got[0].eq(1).all()
    assert set(got[1].tolist()) == {1, 2}  # top-2 at a high temperature: both survive, nothing else
    assert got[2].eq(2).all()  # token 2 holds 98% of the mass, so top_p 0.5 keeps only it


def test_large_vocabulary_draws_cross_block_boundaries_exactly() -> None:
    """V spans several inverse-CDF blocks; the support sits on block edges; nothing else is ever drawn."""
    vocab, rows = 2 * BLOCK + 52, 6000
    support = torch.tensor([0, 5, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, vocab - 1])
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0, 0.5, 2.5, 1.5, 0.5])
    logits = torch.full((1, 1, vocab), -torch.inf)
    logits[0, 0, support] = weights.log()
    got = sample_choices(logits.expand(rows, 1, vocab), torch.ones(rows), torch.ones(rows),
                         torch.zeros(rows, dtype=torch.long), torch.arange(rows), torch.zeros(rows, dtype=torch.long),
                         any_filter=False)
    counts = torch.bincount(got[:, 0], minlength=vocab).double()
    assert float(counts.sum()) == rows
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[support] = (weights / weights.sum()).double() * rows
    assert _chi_square_p(counts, expected) > 1e-3


def test_draws_depend_only_on_seed_step_and_node() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 30, generator=gen)
    temperature, top_p = torch.tensor([1.0, 0.8, 1.2, 1.0, 0.5]), torch.tensor([1.0, 0.9, 1.0, 0.7, 1.0])
    top_k, seed, step = torch.tensor([0, 0, 5, 0, 3]), torch.tensor([11, 2**40 + 3, 11, 5, 6]), torch.tensor([0, 4, 9, 2, 2])
    batch = sample_choices(logits, temperature, top_p, top_k, seed, step)
    for r in range(5):
        alone = sample_choices(logits[r : r + 1], temperature[r : r + 1], top_p[r : r + 1], top_k[r : r + 1],
                               seed[r : r + 1], step[r : r + 1])
        assert torch.equal(batch[r], alone[0])
    # Reordered batch: the same rows, the same draws.
    perm = torch.tensor([3, 0, 4, 2, 1])
    shuffled = sample_choices(logits[perm], temperature[perm], top_p[perm], top_k[perm], seed[perm], step[perm])
    assert torch.equal(shuffled, batch[perm])
    # An unfiltered request draws the same tokens whether or not its batch needed the filtering sort.
    plain = sample_choices(logits[:1], temperature[:1], top_p[:1], top_k[:1], seed[:1], step[:1], any_filter=False)
    assert torch.equal(plain[0], batch[0])


def test_counter_uniform_is_uniform_and_changes_with_every_input() -> None:
    rows = 4000
    seed, step = torch.arange(rows) // 40, torch.arange(rows) % 40
    u = counter_uniform(seed, step, 64)  # [4000, 64]
    assert u.dtype == torch.float64 and float(u.min()) > 0.0 and float(u.max()) <= 1.0
    observed = torch.histc(u.float(), bins=64, min=0.0, max=1.0).double()
    assert _chi_square_p(observed, torch.full((64,), u.numel() / 64, dtype=torch.float64)) > 1e-3
    # Neighbouring steps, seeds and nodes are uncorrelated.
    flat = u.view(100, 40, 64)
    for a, b in ((flat[:, 1:], flat[:, :-1]), (flat[1:], flat[:-1]), (flat[..., 1:], flat[..., :-1])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(corr)) < 0.02
    assert not torch.equal(counter_uniform(torch.tensor([1]), torch.tensor([0]), 8),
                           counter_uniform(torch.tensor([1 + 2**32]), torch.tensor([0]), 8))
    # Per-node steps: the draw is a function of (seed, step) alone, wherever the node sits.
    per_node = counter_uniform(torch.tensor([5, 5]), torch.tensor([[3, 4, 3], [4, 9, 3]]), 3)
    assert per_node[0, 0] == per_node[0, 2] == per_node[1, 2] and per_node[0, 1] == per_node[1, 0]
    assert len(set(per_node.flatten().tolist())) == 3


def test_step_shape_is_checked() -> None:
    with pytest.raises(ShapeError, match=r"step must have shape \[2\] or \[2, 3\]"):
        sample_choices(torch.zeros(2, 3, 4), torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                       torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
