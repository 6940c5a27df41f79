"""Predict greedy acceptance for any budget and top-k from one :class:`~ddtree.lab.replay.trace.Trace`.

For every anchor the recorded top-M log-probs are spread back over the vocabulary (the unrecorded tokens share the
remaining probability mass evenly, each no likelier than the M-th token, so they can never enter a tree of budget
<= M and the log-normaliser is unchanged), the engine's own :func:`ddtree.speculative.build_trees` builds the tree, and
:func:`ddtree.speculative.walk_trees` walks it with the target's choices, which under greedy decoding are simply the
recorded continuation's next tokens (``choice(node at depth d) = t_{j + d + 1}``; nodes off the true path are never
accepted, so their choices do not matter). Then each sequence is replayed round by round, exactly as the engine
commits: start after the prefill's token t_1, commit ``num_accepted`` tokens per round, stop at ``max_tokens``.

The DFlash chain is predicted as the engine runs it (``build_trees`` with top-k 1 and budget = depth) and AR as one
token per round. Results carry the per-round histogram the engine reports (``accept_hist[k]`` = rounds that
committed k tokens, counted before the ``max_tokens`` cut like the engine's), so predictions can be checked
against measured requests round for round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ddtree import speculative
from ddtree.errors import ConfigError
from ddtree.lab.replay.trace import Trace

DENSE_ELEMENTS = 1 << 25  # floats per densified chunk (128 MiB): bounds memory for 150k-token vocabularies


@dataclass(frozen=True)
class Setting:
    method: str  # "ar" | "dflash" | "ddtree"
    budget: int | str = 0  # "auto": budget auto (replayed in the closed loop only: ddtree.lab.replay.auto)
    topk: int | None = None

    @property
    def label(self) -> str:
        if self.method == "ddtree":
            return f"ddtree-b{self.budget}-k{'none' if self.topk is None else self.topk}"
        return self.method


@dataclass
class Prediction:
    setting: Setting
    tokens: int = 0  # completion tokens over all sequences (max_tokens each)
    rounds: int = 0  # verify rounds over all sequences
    accept_hist: list[int] = field(default_factory=list)  # over all sequences
    # accept_length, rounds, accept_hist, commits (tokens committed by each round, in order: what tok/s replays)
    per_sequence: list[dict[str, Any]] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        """Completion tokens per verify round over all sequences (SGLang's definition, the engine's stats)."""
        return self.tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.setting.label,
            "method": self.setting.method,
            "budget": self.setting.budget if self.setting.method == "ddtree" else None,
            "topk": self.setting.topk,
            "accept_length": self.accept_length,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "accept_hist": self.accept_hist,
            "per_sequence": self.per_sequence,
        }


def settings_grid(budgets: Iterable[int], topks: Iterable[int | None], *, baselines: bool = True) -> list[Setting]:
    out = [Setting("ar"), Setting("dflash")] if baselines else []
    out += [Setting("ddtree", b, k) for b in budgets for k in topks]
    return out


def _dense_logprobs(trace: Trace, rows: Tensor) -> Tensor:
    """[C, L, V] log-probs for anchors ``rows``: recorded top-M exactly, the rest sharing the remaining mass."""
    ids = trace.top_ids[rows].long()  # [C, L, M]
    lp = trace.top_logprobs[rows].float()  # [C, L, M]
    vocab, m = trace.vocab_size, ids.shape[-1]
    rest = (1.0 - lp.exp().sum(-1)).clamp(min=0.0)  # [C, L] probability mass outside the top-M
    others = max(vocab - m, 1)
    fill = torch.where(rest > 0, (rest / others).log(), torch.full_like(rest, -math.inf))
    # never likelier than the M-th recorded token (true for the real tokens it stands for, by definition)
    fill = torch.minimum(fill, lp[..., -1])
    dense = fill.unsqueeze(-1).expand(*fill.shape, vocab).clone()
    dense.scatter_(-1, ids, lp)
    return dense


def _next_tokens(trace: Trace) -> Tensor:
    """[A, L + 1] the continuation after each anchor: t_{j+1} .. t_{j+L+1} (-1 past the recorded look-ahead)."""
    depth = trace.depth
    out = torch.full((trace.anchor_seq.shape[0], depth + 1), -1, dtype=torch.long)
    for s in range(trace.num_sequences):
        _, cont = trace.sequence(s)
        padded = torch.tensor(cont + [-1] * (depth + 2), dtype=torch.long)
        sel = (trace.anchor_seq == s).nonzero().squeeze(1)
        j = trace.anchor_j[sel]  # 1-based; t_{j+1} is cont[j]
        out[sel] = padded[j.unsqueeze(1) + torch.arange(depth + 1)]
    return out


def accepted_per_anchor(trace: Trace, settings: Sequence[Setting]) -> dict[Setting, Tensor]:
    """``num_accepted`` (tokens a round anchored there commits, bonus included) for every anchor and setting."""
    depth = trace.depth
    for s in settings:
        # only the top min(B, V) tokens of a depth can enter a tree of budget B
        if s.method == "ddtree" and min(s.budget, trace.vocab_size) > trace.top_m:
            raise ConfigError(
                f"budget {s.budget} needs the top {s.budget} tokens per depth but the trace kept {trace.top_m}; "
                f"record it with top_m >= {s.budget}"
            )
    anchors = trace.anchor_seq.shape[0]
    out = {s: torch.ones(anchors, dtype=torch.long) for s in settings}  # AR: the bonus alone
    drafting = [s for s in settings if s.method != "ar"]
    if not drafting or depth == 0:
        return out
    for rows, dense, roots, nxt in anchor_chunks(trace):
        for s in drafting:
            if s.method == "dflash":
                budget, topk = depth, 1
            else:
                budget, topk = s.budget, s.topk
            trees = speculative.build_trees(dense, budget, topk, max_budget=budget, root_tokens=roots)
            choices = torch.gather(nxt, 1, trees.depths)  # [C, N]: t_{j + depth + 1}
            walk = speculative.walk_trees(trees, choices, depth)
            out[s][rows] = walk.num_accepted
    return out


def anchor_chunks(trace: Trace) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The trace's anchors in chunks whose densified marginals fit :data:`DENSE_ELEMENTS`: per chunk (anchor
    indices ``[C]``, log-probs ``[C, L, V]`` as :func:`_dense_logprobs` spreads them, root tokens ``[C]``, the
    continuation after each anchor ``[C, L + 1]``), what a tree anchored there is built and walked from."""
    nxt = _next_tokens(trace)
    anchors = trace.anchor_seq.shape[0]
    chunk = max(1, DENSE_ELEMENTS // (max(trace.depth, 1) * trace.vocab_size))
    for lo in range(0, anchors, chunk):
        rows = torch.arange(lo, min(lo + chunk, anchors))
        yield rows, _dense_logprobs(trace, rows), _anchor_tokens(trace, rows), nxt[rows]


def _anchor_tokens(trace: Trace, rows: Tensor) -> Tensor:
    """[C] the anchor token t_j of each row (the tree's root)."""
    starts = trace.seq_offsets[trace.anchor_seq[rows]] + trace.prompt_lens[trace.anchor_seq[rows]]
    return trace.tokens[starts + trace.anchor_j[rows] - 1]


def predict(
    trace: Trace, budgets: Iterable[int], topks: Iterable[int | None] = (None,), *, baselines: bool = True
) -> list[Prediction]:
    """Acceptance of every (budget, top-k) setting (plus AR and the DFlash chain) on the trace's sequences."""
    settings = settings_grid(budgets, topks, baselines=baselines)
    accepted = accepted_per_anchor(trace, settings)
    total = trace.max_tokens
    index: dict[tuple[int, int], int] = {
        (int(s), int(j)): a
        for a, (s, j) in enumerate(zip(trace.anchor_seq.tolist(), trace.anchor_j.tolist(), strict=True))
    }
    results = []
    for setting in settings:
        counts = accepted[setting].tolist()
        pred = Prediction(setting)
        for seq in range(trace.num_sequences):
            committed, rounds, hist, commits = 1, 0, [0], []  # t_1 came from the prefill
            while committed < total:
                n = counts[index[(seq, committed)]]
                rounds += 1
                commits.append(n)
                while len(hist) <= n:
                    hist.append(0)
                hist[n] += 1
                committed += n
            pred.per_sequence.append({"accept_length": total / rounds, "rounds": rounds, "accept_hist": hist,
                                      "commits": commits})
            pred.tokens += total
            pred.rounds += rounds
            while len(pred.accept_hist) < len(hist):
                pred.accept_hist.append(0)
            for k, c in enumerate(hist):
                pred.accept_hist[k] += c
        results.append(pred)
    return results


__all__ = ["Prediction", "Setting", "accepted_per_anchor", "anchor_chunks", "predict", "settings_grid"]
