"""Host-side state of one request while the engine runs it.

Everything here is plain Python on the host: token ids, counters, the detokenizer and stop logic. Device tensors
for a round are gathered from these objects once per round (see :mod:`ddtree.engine.batch`), and results come back
through the one host copy at the end of the round.

Positions: a request with ``n`` committed tokens (prompt + generated) has target KV for positions ``0 .. n - 2``;
its last committed token (the *root* of the next tree) sits at position ``n - 1`` and has no KV yet. The drafter's
context cache holds features for the same positions ``0 .. n - 2``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from ddtree.engine.api import (
    FinishReason,
    RequestStats,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
    TreeSettings,
)
from ddtree.engine.detok import IncrementalDetokenizer

if TYPE_CHECKING:
    from ddtree.engine.auto_budget import KeptCurve


class Phase(Enum):
    WAITING = "waiting"  # queued, no slot
    PREFILL = "prefill"  # has a slot, prompt partly in the cache
    DECODE = "decode"  # speculative rounds
    DONE = "done"


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    tree: TreeSettings  # resolved (block_size concrete)
    sampling: SamplingParams
    seed: int
    on_chunk: Callable[[StreamChunk], None]
    detok: IncrementalDetokenizer
    eos_ids: frozenset[int]
    max_len: int
    phase: Phase = Phase.WAITING
    slot: int = -1
    prefilled: int = 0  # prompt tokens whose KV is in the cache
    output_ids: list[int] = field(default_factory=list)
    counted: bool = True  # False for the engine's own warm-up: kept out of the metrics counters
    stats: RequestStats = field(default_factory=RequestStats)
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    # prompt log-probs gathered chunk by chunk during prefill (SamplingParams.prompt_logprobs), handed to the first
    # chunk and then dropped (None for the first prompt token, which nothing predicts)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    _prompt_logprobs_sent: bool = False
    # budget "auto" (ddtree.engine.auto_budget): the budget of the round being built (the scheduler sets it), and the
    # smoothed expected lengths E(1 .. W) of this request's recent trees (empty until its first auto round is read)
    auto_budget: int = 0
    auto_curve: tuple[float, ...] = ()
    # decayed sums of (tokens committed - 1) and (surrogate E at the verified budget - 1) over its rounds: the
    # calibration of the drafter's surrogate against what this request really accepts (auto_budget.gain_update)
    auto_gain: tuple[float, float] = (0.0, 0.0)
    # per tree size m = 1 ..: decayed (sum, count) of the tokens the first m nodes of its verified trees would have
    # committed (auto_budget.observed_update)
    auto_seen: tuple[tuple[float, float], ...] = ()
    # the curve the choice last computed from the three above (and the engine's prior gain where it was used);
    # AutoChooser.row_curve recomputes it only when one of them changed, which happens once per read round, while
    # the choice runs up to twice a round (ddtree.engine.auto_budget.KeptCurve)
    auto_cached: KeptCurve | None = None
    # rounds this request has run at budget 0 (no tree) since its last tree, or since it joined: budget auto probes
    # a tree once the rows' mean reaches auto_budget.PROBE_ROUNDS (AutoChooser.choose)
    auto_idle: int = 0

    # ---- derived positions -------------------------------------------------------------------------------
    @property
    def num_committed(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def root_position(self) -> int:
        """Position of the last committed token (the next tree's root); also the committed KV length."""
        return self.num_committed - 1

    @property
    def root_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def budget(self) -> int:
        """Draft nodes per round: 0 for AR, the chain depth for DFlash, the budget for DDTree."""
        if self.tree.method == "ar":
            return 0
        if self.tree.method == "dflash":
            return self.depth_limit
        if self.tree.auto:
            return self.auto_budget
        return int(self.tree.budget)

    @property
    def topk(self) -> int:
        """Per-depth cap passed to build_trees (0 = none); the chain is top-1."""
        if self.tree.method == "dflash":
            return 1
        return self.tree.topk or 0

    @property
    def depth_limit(self) -> int:
        return 0 if self.tree.method == "ar" else int(self.tree.block_size) - 1

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """The ids min_tokens masks while fewer than min_tokens tokens are out: EOS (unless ignore_eos) and the stop
        token ids, as vLLM; empty without min_tokens (the round then masks nothing for this row)."""
        if self.sampling.min_tokens <= 0:
            return ()
        eos = () if self.sampling.ignore_eos else self.eos_ids
        return tuple(sorted(set(self.sampling.stop_token_ids) | set(eos)))

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt log-probs, once (for the request's first chunk); None if not asked or already taken."""
        if self._prompt_logprobs_sent or self.sampling.prompt_logprobs is None:
            return None
        self._prompt_logprobs_sent = True
        out, self.prompt_logprobs = self.prompt_logprobs or [None] * min(1, len(self.prompt_ids)), None
        return out

    # ---- committing ----------------------------------------------------------------------------------------
    def ends_by_token(self, tokens) -> bool:
        """Whether committing ``tokens`` would finish the request by a token rule (EOS, a stop token id, the
        length limits), the same rules :meth:`commit` applies. Stop *strings* need the text and are not predicted.

        Why: the engine launches the next round before it commits the previous round's tokens; a row predicted to
        finish is left out of that round, a row that finishes on a stop string merely wastes its place in it."""
        if not tokens:
            return False
        if len(self.output_ids) + len(tokens) >= self.sampling.max_tokens:
            return True
        if self.num_committed + len(tokens) >= self.max_len:
            return True
        stops = self.sampling.stop_token_ids
        return any(t in stops or (not self.sampling.ignore_eos and t in self.eos_ids) for t in tokens)

    def commit(self, tokens: list[int]) -> tuple[list[int], str, FinishReason | None]:
        """Append tokens from one round (or the prefill's first token), honouring every stop rule.

        Returns the ids actually kept, the text delta and the finish reason (None while running)."""
        kept: list[int] = []
        reason: FinishReason | None = None
        for tok in tokens:
            kept.append(tok)
            self.output_ids.append(tok)
            if not self.sampling.ignore_eos and tok in self.eos_ids:
                reason = "stop"
                break
            if tok in self.sampling.stop_token_ids:
                reason = "stop"
                break
            if len(self.output_ids) >= self.sampling.max_tokens or self.num_committed >= self.max_len:
                reason = "length"
                break
        text_ids = kept
        if reason == "stop" and kept and (kept[-1] in self.eos_ids or kept[-1] in self.sampling.stop_token_ids):
            text_ids = kept[:-1]  # a stop token is reported in ids but not rendered as text
        # stop strings are not matched before min_tokens tokens are out (vLLM): the tokens up to that count go in
        # unchecked, the rest (and any text a later match straddles) are checked as usual
        unchecked = max(0, self.sampling.min_tokens - (len(self.output_ids) - len(kept)))
        text = self.detok.add(text_ids[:unchecked], check_stop=False) if unchecked else ""
        text += self.detok.add(text_ids[unchecked:])
        if self.detok.stopped:
            reason = "stop"
        if reason is not None:
            text += self.detok.finish()
            if self.detok.stopped:  # a stop string completed by the flushed tail
                reason = "stop"
        return kept, text, reason
