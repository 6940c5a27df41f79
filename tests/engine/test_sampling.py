"""Temperature > 0: the first three generated tokens follow the target's own distribution under every method.

The reference distribution is computed exactly here from full-recompute forwards (``forward_train``) with the
temperature / top-k / top-p filters applied as the documented plain sampler does (temperature, then top-k, then
top-p on the renormalised distribution); the engine's draws under AR, the DFlash chain and DDTree trees are compared
with it by a chi-square test. Token 3 is the one that depends on the tree walk (it is sampled at a matched child).
"""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import GenerationRequest, SamplingParams, TreeSettings

PROMPT = "def parse(line):\n    "


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k > 0:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly before each token
        keep_sorted = before < top_p
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[keep_sorted]] = True
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def exact_cells(target, prompt_ids, temperature, top_k, top_p, width=4):
    """Probabilities of the (t1, t2, t3) cells whose tokens are each among the `width` likeliest."""
    def dist(prefix):
        with torch.inference_mode():
            return filtered_probs(target.forward_train(torch.tensor([prefix])).logits[0, -1], temperature, top_k, top_p)

    cells = {}
    p1 = dist(prompt_ids)
    for t1 in torch.topk(p1, width).indices.tolist():
        p2 = dist(prompt_ids + [t1])
        for t2 in torch.topk(p2, width).indices.tolist():
            p3 = dist(prompt_ids + [t1, t2])
            for t3 in torch.topk(p3, width).indices.tolist():
                cells[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return cells


def chi_square_pvalue(counts: dict, cells: dict, n: int) -> float:
    expected = {c: p * n for c, p in cells.items()}
    merged_obs, merged_exp, rest_obs = 0.0, 0.0, n
    stat, dof = 0.0, 0
    for c, e in expected.items():
        o = counts.get(c, 0)
        rest_obs -= o
        if e < 5:
            merged_obs += o
            merged_exp += e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    other_exp = n - sum(expected.values()) + merged_exp
    other_obs = rest_obs + merged_obs
    if other_exp > 0:
        stat += (other_obs - other_exp) ** 2 / other_exp
        dof += 1
    dof -= 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.2, 0, 1.0), (1.0, 12, 0.9)], ids=["temperature", "top-k+top-p"]
)
def test_sampled_tokens_follow_the_target_distribution(tiny_engine_factory, tiny_pair, tiny_tokenizer,
                                                       temperature, top_k, top_p):
    target, _ = tiny_pair
    prompt_ids = tiny_tokenizer.encode(PROMPT)
    cells = exact_cells(target, prompt_ids, temperature, top_k, top_p)
    assert sum(cells.values()) > 0.2, "the test's cells must carry real mass"
    engine = tiny_engine_factory(oracle=True, noise=1.0, max_batch=64)
    n = 1200
    methods = [TreeSettings(method="ar"), TreeSettings(method="dflash"), TreeSettings(method="ddtree", budget=12)]
    for tree in methods:
        reqs = [
            GenerationRequest(prompt_token_ids=prompt_ids, tree=tree, sampling=SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + i, max_tokens=3, ignore_eos=True))
            for i in range(n)
        ]
        counts: dict = {}
        for out in engine.generate(reqs):
            key = tuple(out.token_ids[:3])
            counts[key] = counts.get(key, 0) + 1
        p = chi_square_pvalue(counts, cells, n)
        assert p > 1e-3, f"{tree.method}: sampled tokens do not follow the target (chi-square p={p:.2e})"


def test_seeded_requests_reproduce(tiny_engine_factory, tiny_tokenizer):
    engine = tiny_engine_factory(oracle=True)
    req = GenerationRequest(prompt=PROMPT, tree=TreeSettings(method="ddtree", budget=8),
                            sampling=SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True))
    a = engine.generate([req])[0].token_ids
    # the same request again, now sharing its rounds with others
    others = [GenerationRequest(prompt="import re\n", sampling=SamplingParams(temperature=1.0, max_tokens=30))
              for _ in range(3)]
    outs = engine.generate([*others, req])
    assert outs[-1].finish_reason == "length", outs[-1].error
    assert a == outs[-1].token_ids and len(a) == 24


def test_seeded_sampling_is_identical_across_methods(tiny_engine_factory, tiny_tokenizer):
    """Randomness is keyed by output position, so a seeded request samples the very same tokens whatever the
    method or tree: the strongest form of lossless sampling (token for token, not only in distribution)."""
    engine = tiny_engine_factory(oracle=True, noise=1.0)
    trees = [TreeSettings(method="ar"), TreeSettings(method="dflash"), TreeSettings(method="ddtree", budget=4),
             TreeSettings(method="ddtree", budget=24, topk=3)]
    for seed in (1, 2, 3):
        outs = engine.generate([
            GenerationRequest(prompt=PROMPT, tree=t, sampling=SamplingParams(
                temperature=1.0, top_p=0.95, seed=seed, max_tokens=30, ignore_eos=True))
            for t in trees
        ])
        for t, out in zip(trees, outs, strict=False):
            assert out.finish_reason == "length" and len(out.token_ids) == 30, out.error
            assert out.token_ids == outs[0].token_ids, f"seed {seed}: {t} differs from AR"
