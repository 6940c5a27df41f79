"""Budget ``auto`` replayed: the engine's own chooser, run round by round over a trace's recorded drafter marginals.

A fixed setting commits the same tokens a round whatever else the batch holds, so :mod:`ddtree.lab.replay.predict`
gives its rounds once and the closed loop (:mod:`ddtree.lab.replay.throughput`) only prices them. Auto's size
depends on the batch (the rows in flight, their keys, the cost curve) and on what each row's earlier rounds
accepted, so it is replayed inside the closed loop: each round, the decoding requests' rows go through
:meth:`ddtree.engine.auto_budget.AutoChooser.choose` with the cost curve at that round's rows and keys (the price
the scheduler reads: ``round_seconds(rows, b, furthest root + b + 1, keeps_context=True)``), and every row's outcome
goes back through :meth:`~ddtree.engine.auto_budget.AutoChooser.read_row` (a tree) or
:meth:`~ddtree.engine.auto_budget.AutoChooser.read_idle` (budget 0), as ``Scheduler._collect`` reads a round.

What an auto round of any size tells the engine is in the trace, per anchor (the round's last committed token):

* ``E(1 .. W)``, the surrogate expected lengths of the best tree of every size
  (:func:`ddtree.speculative.tree_select.expected_lengths` of the best-first tree at the largest candidate, built
  from the marginals :mod:`~ddtree.lab.replay.predict` densifies: exact for trees up to the trace's ``top_m``);
* the accepted path of a greedy walk of that tree, as node ranks: best-first order is prefix-closed, so the tree
  of the first ``b`` nodes accepts exactly the path's nodes of rank ``<= b`` (a prefix of the path), and a round at
  ``b`` commits one more than their count.

Not modelled (stated, as for fixed settings): rounds the engine launches before the previous one is read (on CUDA a
follow-up round may run at the size chosen one round earlier); the served rows' bucket (the engine prices a graphed
round at its rows bucket, here at its rows, as the fixed settings' rounds are priced); sampled rows (a trace is
greedy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ddtree import speculative
from ddtree.engine import auto_budget
from ddtree.engine.cuda_graphs import bucket_nodes
from ddtree.errors import ConfigError
from ddtree.lab.replay.predict import anchor_chunks
from ddtree.lab.replay.trace import Trace
from ddtree.speculative.tree_select import expected_lengths


@dataclass(frozen=True)
class AutoAnchors:
    """Per anchor of a trace, what an auto round anchored there reports and accepts at every size."""

    max_budget: int  # the engine's: auto's candidates are 2^k - 1 up to it
    topk: int | None  # the requests' per-depth cap (None: none)
    expected: list[tuple[float, ...]]  # [A] E(1 .. largest candidate), non-decreasing
    ranks: list[tuple[int, ...]]  # [A] the accepted path's node ranks in the largest candidate's tree, increasing
    index: dict[tuple[int, int], int]  # (sequence, completion tokens committed) -> anchor
    num_sequences: int

    @property
    def candidates(self) -> tuple[int, ...]:
        return auto_budget.candidates(self.max_budget)


def auto_anchors(trace: Trace, max_budget: int = 64, topk: int | None = None) -> AutoAnchors:
    """Every anchor's expected lengths and accepted ranks (module doc) for an engine whose ``max_budget`` bounds
    auto's candidates. The trace must hold the largest candidate's top tokens per depth (``top_m``)."""
    if max_budget < 1:
        raise ConfigError(f"max_budget must be >= 1, got {max_budget}")
    largest = max(auto_budget.candidates(max_budget))
    if min(largest, trace.vocab_size) > trace.top_m:
        raise ConfigError(f"budget auto up to {largest} nodes needs the top {largest} tokens per depth but the trace "
                          f"kept {trace.top_m}; record it with top_m >= {largest}, or pass a smaller max_budget")
    if trace.depth < 1:
        raise ConfigError("budget auto needs a drafting block (block_size >= 2); the trace's is 1")
    expected: list[tuple[float, ...]] = []
    ranks: list[tuple[int, ...]] = []
    for _, dense, roots, nxt in anchor_chunks(trace):
        trees = speculative.build_trees(dense, largest, topk, max_budget=largest, root_tokens=roots)
        choices = torch.gather(nxt, 1, trees.depths)  # [C, N]: the continuation's next token at each node
        walk = speculative.walk_trees(trees, choices, trace.depth)
        e: Tensor = expected_lengths(trees.scores)  # [C, largest]
        expected += [tuple(row) for row in e.tolist()]
        for path, n in zip(walk.path.tolist(), walk.num_accepted.tolist(), strict=True):
            ranks.append(tuple(path[1:n]))
    index = {(int(s), int(j)): a for a, (s, j) in enumerate(zip(trace.anchor_seq.tolist(), trace.anchor_j.tolist(),
                                                                   strict=True))}
    return AutoAnchors(max_budget, topk, expected, ranks, index, trace.num_sequences)


class _AutoTree:
    """The tree settings the chooser reads of an auto row."""

    auto = True
    method = "ddtree"


@dataclass
class _Row:
    """A replayed auto request: the :class:`~ddtree.engine.request_state.RequestState` fields the chooser reads and
    writes."""

    request_id: str
    tree: _AutoTree = field(default_factory=_AutoTree)
    auto_budget: int = 0
    auto_curve: tuple[float, ...] = ()
    auto_gain: tuple[float, float] = (0.0, 0.0)
    auto_seen: tuple[tuple[float, float], ...] = ()
    auto_cached: auto_budget.KeptCurve | None = None
    auto_idle: int = 0
    sizes: dict[int, int] = field(default_factory=dict)  # rounds per size (the engine's stats' auto_budgets)
    commits: list[int] = field(default_factory=list)  # tokens each round committed

    @property
    def budget(self) -> int:
        return self.auto_budget


class AutoRounds:
    """The closed loop's round model for budget auto (:class:`ddtree.lab.replay.throughput.RoundModel`): request
    ``i`` of a run replays trace sequence ``sequences[i]``; one :class:`~ddtree.engine.auto_budget.AutoChooser`
    per run, as one engine serves a cell's requests (its engine-wide calibration carries across them)."""

    keeps_context = True  # a round at budget 0 keeps the drafter's context (priced at the curve's context points)

    def __init__(self, anchors: AutoAnchors, sequences: Sequence[int]) -> None:
        self.anchors = anchors
        self.sequences = list(sequences)
        self.chooser = auto_budget.AutoChooser(anchors.max_budget)
        self.rows = [_Row(str(i)) for i in range(len(self.sequences))]

    @property
    def budgets(self) -> dict[int, int]:
        """Row-rounds per chosen size over the run's requests."""
        out: dict[int, int] = {}
        for row in self.rows:
            for b, n in row.sizes.items():
                out[b] = out.get(b, 0) + n
        return out

    def round(self, requests: Sequence[int], done: Sequence[int],
              price: Callable[[int], float]) -> tuple[int, list[int]]:
        """One round of ``requests`` (``done[i]``: completion tokens request ``requests[i]`` has): the size the
        chooser takes at ``price`` (seconds of a round at each budget) and each row's committed tokens."""
        states = [self.rows[i] for i in requests]
        chosen, best = self.chooser.choose(states, price)
        self.chooser.previous = best  # as the scheduler: the hysteresis keeps the best, not an explored size
        width = auto_budget.curve_width(bucket_nodes(chosen), self.chooser.candidates) if chosen else 0
        commits = []
        for i, d, state in zip(requests, done, states, strict=True):
            key = (self.sequences[i], d)
            if key not in self.anchors.index:
                raise ConfigError(f"sequence {key[0]} has no anchor after {d} tokens (the trace is shorter)")
            anchor = self.anchors.index[key]
            state.auto_budget = chosen
            if chosen == 0:
                self.chooser.read_idle(state)
                commits.append(1)
            else:
                ranks = self.anchors.ranks[anchor]
                accepted = sum(1 for r in ranks if r <= chosen)  # ranks increase: the part inside the tree
                self.chooser.read_row(state, 1 + accepted, self.anchors.expected[anchor][:width],
                                      (0, *ranks[:accepted]), chosen)
                commits.append(1 + accepted)
            state.sizes[chosen] = state.sizes.get(chosen, 0) + 1
            state.commits.append(commits[-1])
        return chosen, commits


__all__ = ["AutoAnchors", "AutoRounds", "auto_anchors"]
