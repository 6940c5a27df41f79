"""budget "auto" with temperature > 0: sampled outputs still follow the target, and seeded ones equal AR's.

Reuses the exact reference distribution and the chi-square test of ``test_sampling`` (full-recompute forwards,
the documented filters); auto rows share their rounds with fixed rows of other budgets.
"""

from __future__ import annotations

import pytest
from test_sampling import PROMPT, chi_square_pvalue, exact_cells

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings
from ddtree.engine.cost_curve import make_curve


def _curve(max_batch: int, per_node: float = 2e-4):
    """Nodes neither free nor dear (the default), so auto moves between sizes as the drafter's confidence moves;
    dearer, so that no tree (budget 0) takes a share of the rounds too."""
    return make_curve("cpu", "hand", (1, max_batch), (0, 1, 3, 7, 15, 31), (64, 1024),
                      lambda r, b, k: 0.010 + per_node * r * (b + 1) + 1e-7 * k)


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["beside-fixed", "no-tree"])
def test_auto_sampled_tokens_follow_the_target_distribution(tiny_engine_factory, tiny_pair, tiny_tokenizer, mix):
    """Sampled auto rows (beside a fixed b5 row; or alone, under a curve where rounds at no tree and rounds with
    trees both occur) follow the target's distribution."""
    target, _ = tiny_pair
    prompt_ids = tiny_tokenizer.encode(PROMPT)
    temperature, top_k, top_p = 1.0, 12, 0.9
    cells = exact_cells(target, prompt_ids, temperature, top_k, top_p)
    assert sum(cells.values()) > 0.2, "the test's cells must carry real mass"
    engine = tiny_engine_factory(oracle=True, noise=1.0, max_batch=64)
    engine.cost_curve = _curve(64) if mix == "beside-fixed" else _curve(64, 2e-3)
    n = 1200
    trees = [TreeSettings(budget="auto"), TreeSettings(budget="auto", topk=3),
             TreeSettings(budget=5) if mix == "beside-fixed" else TreeSettings(budget="auto")]
    reqs = [GenerationRequest(prompt_token_ids=prompt_ids, tree=trees[i % 3], sampling=SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=5000 + i, max_tokens=3, ignore_eos=True))
        for i in range(n)]
    counts: dict = {}
    outs = engine.generate(reqs)
    for out in outs:
        key = tuple(out.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    p = chi_square_pvalue(counts, cells, n)
    assert p > 1e-3, f"auto: sampled tokens do not follow the target (chi-square p={p:.2e})"
    assert any(out.stats.auto_budgets for out in outs)
    if mix == "no-tree":
        sizes = {b for out in outs for b in out.stats.auto_budgets}
        assert 0 in sizes and sizes - {0}, sizes


@pytest.mark.parametrize("mix", ["beside-fixed", "no-tree"])
def test_seeded_auto_samples_the_same_tokens_as_ar(tiny_engine_factory, tiny_tokenizer, mix):
    """Randomness is keyed by output position, so whatever sizes auto picks a seeded request samples AR's tokens:
    beside fixed rows, or beside AR alone with the real drafter (its trees commit nothing past the root) under a curve
    where auto then runs rounds at no tree."""
    engine = tiny_engine_factory(oracle=mix == "beside-fixed", noise=1.0)
    engine.cost_curve = _curve(8) if mix == "beside-fixed" else _curve(8, 2e-3)
    trees = [TreeSettings(method="ar"), TreeSettings(budget="auto"), TreeSettings(budget=4),
             TreeSettings(budget="auto", topk=2), TreeSettings(method="dflash")]
    if mix == "no-tree":
        trees = [TreeSettings(method="ar"), TreeSettings(budget="auto"), TreeSettings(budget="auto", topk=2)]
    for seed in (1, 2):
        outs = engine.generate([GenerationRequest(prompt=PROMPT, tree=t, sampling=SamplingParams(
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=30, ignore_eos=True)) for t in trees])
        for t, out in zip(trees, outs, strict=True):
            assert out.finish_reason == "length" and len(out.token_ids) == 30, out.error
            assert out.token_ids == outs[0].token_ids, f"seed {seed}: {t} differs from AR"
        assert len(outs[1].stats.auto_budgets) >= 1
        if mix == "no-tree":
            assert 0 in outs[1].stats.auto_budgets
