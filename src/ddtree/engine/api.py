"""The engine's public vocabulary: per-request settings, requests, streamed chunks and statistics.

The server, the lab and scripts speak only these types; the engine validates them once at the edge
(:meth:`TreeSettings.validated`, :meth:`SamplingParams.validated`) so a bad request fails before it takes a KV
slot, with an :class:`~ddtree.errors.InvalidRequestError` whose ``param`` names the field.

Terms
-----
method
    ``ar`` (plain decoding: one token per target forward), ``dflash`` (the drafter's top-1 chain of depth
    ``block_size - 1``), ``ddtree`` (the ``budget`` most probable prefixes under the drafter's marginals).
budget
    Number of draft nodes verified per round, the root (the last committed token) not counted; ``"auto"``: the
    engine chooses it every round, for the most committed tokens per second of the whole batch, from the drafter's
    own confidence and the engine's cost curve (:mod:`ddtree.engine.auto_budget`).
topk
    Most candidates kept per draft depth; ``None`` means no cap (``min(budget, vocab)``), which keeps the tree
    optimal under the drafter's factorized surrogate.
block_size
    Positions per drafter pass (the anchor token plus ``block_size - 1`` masks); the tree's maximum depth is
    ``block_size - 1``. ``None`` means the drafter's trained block size.
draft_window
    The drafter sees only the last ``draft_window`` context positions; ``None`` means all.
acceptance length
    Counted like SGLang: completion tokens / verify rounds (the bonus token included).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ddtree.errors import InvalidRequestError

Method = Literal["ar", "dflash", "ddtree"]
METHODS: tuple[str, ...] = ("ar", "dflash", "ddtree")
FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_LOGPROBS = 20  # the most top log-probs a request may ask for per position (OpenAI's bound, vLLM's default)
# min_tokens: the token ids a round masks per row (EOS ids plus stop_token_ids) ride in the round's packed inputs
# as this many fixed columns (a fixed width keeps one CUDA graph per shape)
MAX_STOP_IDS = 16
AUTO_BUDGET = "auto"  # TreeSettings.budget: the engine chooses the tree size per round (ddtree.engine.auto_budget)


@dataclass(frozen=True)
class TreeSettings:
    """How one request speculates. Every field may differ between requests that share a round."""

    method: Method = "ddtree"
    budget: int | str = 16  # or AUTO_BUDGET ("auto")
    topk: int | None = None
    block_size: int | None = None
    draft_window: int | None = None

    def merged(self, overrides: dict[str, Any] | None) -> TreeSettings:
        """These settings with the non-``None``-keyed entries of ``overrides`` applied (unknown keys rejected).

        An explicit ``None`` for ``topk``/``block_size``/``draft_window`` means "no cap / trained / all"."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown tree setting(s) {unknown}; known: {sorted(known)}", param="ddtree"
            )
        return dataclasses.replace(self, **overrides)

    def validated(self, *, trained_block_size: int, max_block_size: int, max_budget: int) -> TreeSettings:
        """Check ranges and resolve ``block_size=None`` to the drafter's trained block size.

        ``max_block_size`` and ``max_budget`` are the engine's preallocated limits."""
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}", param="method"
            )
        if isinstance(self.budget, str):
            if self.budget != AUTO_BUDGET:
                raise InvalidRequestError(f'budget must be an integer or "auto", got {self.budget!r}', param="budget")
        else:
            _check_int("budget", self.budget, 1, max_budget)
        if self.topk is not None:
            _check_int("topk", self.topk, 1, None)
        block = trained_block_size if self.block_size is None else self.block_size
        _check_int("block_size", block, 2, max_block_size)
        if self.draft_window is not None:
            _check_int("draft_window", self.draft_window, block, None)
        return dataclasses.replace(self, block_size=block)

    @property
    def auto(self) -> bool:
        """Whether the engine chooses this request's budget per round (``budget == "auto"``, method ddtree)."""
        return self.method == "ddtree" and self.budget == AUTO_BUDGET

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter on the target's distribution
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probs of the target's raw distribution (log_softmax of its logits before temperature / top-p / top-k,
    # vLLM's default ``logprobs_mode="raw_logprobs"``): None = not computed; N = the chosen token's log-prob plus
    # the N most probable tokens (0 <= N <= MAX_LOGPROBS) at every emitted token (``logprobs``) or every prompt
    # position after the first (``prompt_logprobs``, for ``echo``; the first prompt token has none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's min_tokens: neither EOS (unless ignore_eos) nor a stop token id may be chosen, and no stop string is
    # matched, before this many tokens are emitted; the engine masks those ids out of the target's logits at every
    # tree node (and the prefill's first token) whose output index is below it, so AR, chain and tree stay lossless
    min_tokens: int = 0

    def validated(self) -> SamplingParams:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature"
            )
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        _check_int("top_k", self.top_k, 0, None)
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                                      param="min_tokens")
        if len(set(self.stop_token_ids)) > MAX_STOP_IDS and self.min_tokens > 0:
            raise InvalidRequestError(
                f"min_tokens > 0 allows at most {MAX_STOP_IDS} distinct stop_token_ids (with EOS), "
                f"got {len(set(self.stop_token_ids))}", param="stop_token_ids")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationRequest:
    """One request: a prompt (text or token ids) plus its settings.

    Exactly one of ``prompt`` and ``prompt_token_ids`` is given; ``chat`` messages, when used, are rendered to
    ``prompt`` by the caller (the server applies the tokenizer's chat template)."""

    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    tree: TreeSettings | None = None  # None = the engine's current defaults
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass
class RequestStats:
    """Per-request speculative statistics, filled in as the request runs."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_rounds: int = 0
    # accept_hist[k] = rounds that committed k tokens (bonus included, so k >= 1)
    accept_hist: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    latency_s: float | None = None
    queue_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)  # draft, tree, verify, commit, prefill
    finish_reason: FinishReason | None = None
    tree: dict[str, Any] = field(default_factory=dict)  # the resolved TreeSettings
    # budget "auto": rounds per chosen budget ({budget: rounds}; empty for a fixed budget)
    auto_budgets: dict[int, int] = field(default_factory=dict)
    # time.perf_counter() when submit accepted the request; ttft_s and latency_s count from it. This process's
    # clock: it places one engine's requests on one time line (a benchmark's closed loop), so to_dict leaves it out
    submitted_at: float | None = None

    @property
    def accept_length(self) -> float:
        """SGLang's ``spec_accept_length``: completion tokens per verify round (bonus included)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def mean_auto_budget(self) -> float | None:
        """The mean budget auto chose over this request's rounds (None for a fixed budget)."""
        rounds = sum(self.auto_budgets.values())
        return sum(b * n for b, n in self.auto_budgets.items()) / rounds if rounds else None

    @property
    def first_token_at(self) -> float | None:
        """perf_counter() when the first token was emitted (``submitted_at + ttft_s``)."""
        return None if self.submitted_at is None or self.ttft_s is None else self.submitted_at + self.ttft_s

    @property
    def finished_at(self) -> float | None:
        """perf_counter() when the request finished (``submitted_at + latency_s``)."""
        return None if self.submitted_at is None or self.latency_s is None else self.submitted_at + self.latency_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["submitted_at"]
        out["accept_length"] = self.accept_length
        if self.auto_budgets:
            out["mean_auto_budget"] = self.mean_auto_budget
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probs under the target: the token there, its log-prob, and the request's ``N`` most
    probable tokens with theirs (most probable first; equal values in token-id order, as ``torch.topk``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-prob), N entries


@dataclass
class StreamChunk:
    """New output since the previous chunk. The final chunk has ``finished=True`` and carries ``stats``."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    error: str | None = None  # set when finish_reason == "error"
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them
    # the first chunk of a request that asked prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class GenerationOutput:
    """A finished request, as returned by the blocking :meth:`Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (SamplingParams.prompt_logprobs)


def parse_budget(text: str | int) -> int | str:
    """A budget as a command line spells it: an integer, or ``"auto"``; anything else raises ``ValueError`` with
    a message naming the accepted forms (the CLIs turn it into a usage error of ``--budget``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    value = str(text).strip()
    if value == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"budget must be an integer or 'auto', got {text!r}") from None


def _check_int(name: str, value: Any, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}", param=name)
