"""One request's speculative statistics in the shapes other engines' clients read.

The engine counts, per request, ``accept_hist[k]`` = verify rounds that committed ``k`` tokens (the bonus token
included, so ``k >= 1``; see :class:`~ddtree.engine.api.RequestStats`). SGLang and vLLM count by **accepted
drafts** instead (the bonus excluded): ``hist[j]`` = rounds that accepted exactly ``j`` draft tokens, so
``hist[j] = accept_hist[j + 1]``. Worked example: a request whose three rounds committed 1, 3 and 2 tokens has
``accept_hist = [0, 1, 1, 1]`` and accepted-draft histogram ``[1, 1, 1]``: 0 + 2 + 1 = 3 accepted drafts.

Draft tokens proposed per round (the denominator of an acceptance *rate*): ``budget`` tree nodes for ``ddtree``
(what SGLang counts for an EAGLE tree: ``speculative_num_draft_tokens - 1``), ``block_size - 1`` for the DFlash
chain, none for ``ar``. The deepest a round can accept (vLLM's ``num_spec_tokens``, the histogram's last index):
``min(budget, block_size - 1)`` for a tree, ``block_size - 1`` for the chain, 0 for ``ar``. A request of budget
``"auto"`` proposes the budget each round chose (``RequestStats.auto_budgets``: rounds per size), and the deepest is
``min(largest chosen, block_size - 1)``; vLLM's object then also carries ``auto_budget_mean`` and
``auto_budget_counts`` (``{"15": 3, "7": 9}``: rounds per chosen budget).

Shapes produced here:

- :func:`sglang_meta_info`: SGLang's per-request ``meta_info`` (``spec_verify_ct``, ``spec_accept_length`` =
  completion tokens / verify rounds, ``spec_accept_rate`` = accepted / proposed drafts, the histogram by accepted
  drafts under its current and older names).
- :func:`vllm_speculative_decoding`: vLLM's per-request ``metrics.speculative_decoding`` (what AIPerf reads):
  ``mean_acceptance_length`` = 1 + accepted drafts / rounds, ``draft_acceptance_rate``, a dense
  ``acceptance_histogram`` of ``num_spec_tokens + 1`` buckets, ``num_accepted_draft_tokens``,
  ``num_draft_tokens``, ``num_spec_steps``, ``num_spec_tokens``.
- :func:`accepted_per_position`: vLLM's ``spec_decode_num_accepted_tokens_per_pos`` for one request: position
  ``p`` counts the rounds that accepted more than ``p`` drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddtree.engine.api import RequestStats

# Engine finish reasons as OpenAI clients see them; "cancelled" and "error" never reach a 200 response.
FINISH_REASONS: dict[str, str] = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


@dataclass(frozen=True)
class SpecCounts:
    """One request's rounds in accepted-draft terms (the numbers every shape below is made of)."""

    rounds: int
    proposed: int  # draft tokens verified over all rounds
    accepted: int  # draft tokens accepted (bonus excluded)
    max_depth: int  # the most drafts one round can accept
    hist: tuple[int, ...]  # [j] = rounds that accepted exactly j drafts; max_depth + 1 buckets
    speculative: bool  # False for ar: vLLM counts no drafts for a request that does not speculate

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def _tree_shape(stats: RequestStats) -> tuple[int, int]:
    """(draft tokens over all rounds, deepest acceptance per round) of a request's resolved tree settings."""
    tree = stats.tree
    method = tree.get("method", "ddtree")
    block = int(tree.get("block_size") or 1)
    rounds = stats.verify_rounds
    if method == "ar":
        return 0, 0
    if method == "dflash":
        return rounds * (block - 1), block - 1
    if stats.auto_budgets:  # budget "auto": each round proposed the budget it chose
        return sum(b * n for b, n in stats.auto_budgets.items()), min(max(stats.auto_budgets), block - 1)
    budget = tree.get("budget")
    budget = budget if isinstance(budget, int) else 0  # "auto" before any round: nothing proposed yet
    return rounds * budget, min(budget, block - 1)


def spec_counts(stats: RequestStats) -> SpecCounts:
    proposed, depth = _tree_shape(stats)
    drafts = [stats.accept_hist[k + 1] if k + 1 < len(stats.accept_hist) else 0 for k in range(depth + 1)]
    # A round can never accept more than the tree is deep; should the engine ever report more, keep the counts
    # honest by widening the histogram rather than dropping rounds.
    drafts += list(stats.accept_hist[depth + 2:])
    rounds = stats.verify_rounds
    return SpecCounts(rounds=rounds, proposed=proposed,
                      accepted=sum(j * c for j, c in enumerate(drafts)), max_depth=len(drafts) - 1,
                      hist=tuple(drafts), speculative=stats.tree.get("method", "ddtree") != "ar")


def accepted_per_position(counts: SpecCounts) -> list[int]:
    """[p] = rounds that accepted draft position p (0-based), i.e. more than p drafts."""
    return [sum(counts.hist[p + 1:]) for p in range(counts.max_depth)]


def sglang_meta_info(request_id: str, stats: RequestStats) -> dict[str, Any]:
    """SGLang's per-request ``meta_info`` keys, so tools written for SGLang read our acceptance unchanged."""
    c = spec_counts(stats)
    reason = stats.finish_reason or "stop"
    hist = list(c.hist)
    return {
        "id": request_id,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "spec_verify_ct": stats.verify_rounds,
        "spec_accept_length": stats.accept_length,
        "spec_accept_rate": c.accept_rate,
        "spec_num_correct_drafts": c.accepted,
        "spec_num_proposed_drafts": c.proposed,
        "spec_accepted_drafts": c.accepted,  # SGLang's older spellings, still sent by it as aliases
        "spec_proposed_drafts": c.proposed,
        "spec_correct_drafts_histogram": hist,
        "spec_accept_histogram": hist,
        "finish_reason": {"type": FINISH_REASONS.get(reason, reason)},
        "e2e_latency": stats.latency_s,
        "ttft": stats.ttft_s,
        "queue_time": stats.queue_s,
    }


def vllm_speculative_decoding(stats: RequestStats) -> dict[str, Any]:
    """vLLM's per-request ``metrics.speculative_decoding`` object."""
    c = spec_counts(stats)
    auto = {} if not stats.auto_budgets else {
        "auto_budget_mean": stats.mean_auto_budget,
        "auto_budget_counts": {str(b): n for b, n in sorted(stats.auto_budgets.items())}}
    return {
        **auto,
        "num_spec_steps": c.rounds,
        "num_spec_tokens": c.max_depth,
        "num_draft_tokens": c.proposed,
        "num_accepted_draft_tokens": c.accepted,
        "draft_acceptance_rate": c.accept_rate,
        "mean_acceptance_length": 1.0 + c.accepted / c.rounds if c.rounds else 1.0,
        "acceptance_histogram": list(c.hist),
    }
