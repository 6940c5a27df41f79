"""Why two greedy runs differ: the first differing token, classified against the baseline's log-probs.

The lossless gate compares each speculative configuration's greedy outputs with the baseline's (plain decoding,
the AR config). On an engine whose forward is not batch-invariant (SGLang, vLLM, a ddtree server without exact
mode, any bf16 GPU engine) the same position can get logits a few ulps apart in the two runs, and where the top two
tokens are nearly tied the argmax flips: the outputs differ although nothing is wrong. A real verification bug (a
wrong mask, a RoPE offset, a compaction error) also makes outputs differ. This module tells the two apart.

Terms:

trace
    one run's emitted tokens as the server returned them (:class:`TokenTrace`): the token strings, their ids where
    the engine gives them, and (for the baseline) each position's log-prob of the chosen token and the top-N
    ``(token, log-prob)`` entries of the target's distribution there.
first differing token
    the first index ``k`` at which the two traces' tokens differ, compared by token id when both traces carry ids
    and by the token string otherwise. Alignment is by index: tokens ``0 .. k-1`` are equal, so both runs had
    emitted the same prefix when they chose token ``k``, and the baseline's distribution at ``k`` is the one the
    other run's choice is judged against. (Two different tokens with the same string, e.g. the replacement
    character of a split UTF-8 sequence, look equal without ids; the difference is then found at the next
    token.) When one trace is a prefix of the other, ``k`` is the shorter one's length.
drift
    where the other run reports log-probs too (the lab's gate asks every run for them), the largest difference
    between the two runs' log-probs of the same token at the same position, over the common prefix ``0 .. k-1``
    and the other run's own token at ``k``. Two runs that compute the same distribution up to rounding agree
    there within rounding; a verify that computes a different distribution (a shifted position, a wrong mask)
    shows it here, often before any token differs.
numeric near-tie
    the baseline's log-prob of its own token at ``k`` and of the other run's token at ``k`` are within
    ``margin`` nats, and the drift (when known) is within ``margin`` too: a flip that rounding can explain.
real divergence
    anything else, reported loudly: a wider gap; a drift wider than the margin; the other run's token missing
    from the baseline's top-N (its log-prob is then below the N-th entry's, so the gap is at least ``own - lowest
    listed``, but how far below is unknown, and it is never called a tie); one run ending where the other goes on
    (the end token is not reported, so no gap can be shown); the baseline without log-probs at ``k``; or equal
    tokens with different texts.

The margin (:data:`DEFAULT_NEAR_TIE_MARGIN`, 0.5 nats): two tokens' log-probs at one position differ by exactly the
difference of their logits (``log_softmax`` subtracts the same log-sum-exp from both), so the margin bounds a logit
difference. The engines in question compute the final logits in bf16, which keeps 8 significant bits: a logit in
``[2^e, 2^(e+1))`` is a multiple of ``2^(e-7)``, one ulp is 0.0625 for ``|logit|`` in [8, 16) and 0.125 in
[16, 32). The project's divergence study (``benchmarks/divergence.py``, run 7 on the H200 stand-in, whose leading
logits sit near 16) found verify-shaped forwards moving every logit by one or two ulps (max-abs difference: median
0.0625, max 0.125), and argmax flips only where the plain decode's top two were 0 or 0.0625 apart. A flip needs
the gap closed by both tokens' errors together: at most 2 x 0.125 = 0.25 nats measured there; 0.5 nats is the same
two-ulp bound for leading logits up to 32 (2 tokens x 2 ulps x 0.125), so a gap below it is one bf16 rounding of
the logits can close and a wider one is more than it explains. Models whose leading logits exceed 32 (ulp 0.25)
want a margin of 1.0: the margin is a gate setting (``near_tie_margin``), recorded in the result. An fp32 engine
wants :data:`FP32_NEAR_TIE_MARGIN` (1e-3): an fp32 ulp at 16 is 1.9e-6, and the same study measured fp32
differences of 5e-6 to 1.9e-5; on the demo pair in fp32 a healthy tree's log-probs drifted at most 7e-6 from AR's,
one shifted tree position by 0.1-0.3 nats (``tests/lab/humaneval/test_divergence_gate.py``). A flat distribution
makes the first differing token a near-tie even under a bug; the drift is what still exposes it.

Worked example (margin 0.5)::

    baseline tokens  ["def", " f", "(", "x"]   top at 2: {"(": -0.40, ":": -0.61, "[": -3.2}
    other tokens     ["def", " f", ":", ...]
    -> k = 2, baseline's own log-prob -0.40, of ":" -0.61, gap 0.21 <= 0.5: near-tie.
    other tokens     ["def", " f", "[", ...]  -> gap 2.8 > 0.5: real.
    other tokens     ["def", " f", " =", ...] -> " =" not in the top 3: real (gap >= 2.8).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ddtree.errors import ConfigError

DEFAULT_NEAR_TIE_MARGIN = 0.5  # nats, for bf16 engines; see the module docstring for where the number comes from
FP32_NEAR_TIE_MARGIN = 1e-3  # nats, for fp32 engines (the CPU path)
CONTEXT_TOKENS = 6  # tokens of each continuation shown in a report, from the first differing one
TOP_LOGPROBS = 5  # the baseline's N: top log-probs requested per position by the gate

Kind = Literal["near_tie", "real"]


def check_margin(margin: Any) -> float:
    """``margin`` as a float, or a :class:`ConfigError` naming the problem (finite, >= 0)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise ConfigError(f"near_tie_margin must be a finite number of nats >= 0, got {margin!r}")
    return float(margin)


@dataclass(frozen=True)
class TopEntry:
    """One of the top-N tokens of a position's distribution."""

    token: str
    logprob: float
    token_id: int | None = None


@dataclass(frozen=True)
class TokenTrace:
    """One run's emitted tokens. Every present field has one entry per token (``T`` entries).

    ``token_ids``: ``[T]`` or None (the engine gave none); ``logprobs``: ``[T]`` the chosen token's log-prob, or
    None (not requested); ``top``: ``[T]`` tuples of the N most probable tokens (most probable first), or None."""

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float | None, ...] | None = None
    top: tuple[tuple[TopEntry, ...] | None, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("token_ids", "logprobs", "top"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.tokens):
                raise ConfigError(f"trace {name} has {len(value)} entries for {len(self.tokens)} tokens")

    def to_json(self) -> dict[str, Any]:
        """The trace as stored in a task record: top entries as ``[token, logprob]`` or ``[token, logprob, id]``."""
        top = None
        if self.top is not None:
            top = [None if entries is None else
                   [[e.token, e.logprob] if e.token_id is None else [e.token, e.logprob, e.token_id] for e in entries]
                   for entries in self.top]
        return {"tokens": list(self.tokens), "token_ids": None if self.token_ids is None else list(self.token_ids),
                "logprobs": None if self.logprobs is None else list(self.logprobs), "top_logprobs": top}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenTrace:
        """The inverse of :meth:`to_json`; a :class:`ConfigError` when the record is malformed."""
        try:
            top = data.get("top_logprobs")
            return cls(
                tokens=tuple(str(t) for t in data["tokens"]),
                token_ids=None if data.get("token_ids") is None else tuple(int(i) for i in data["token_ids"]),
                logprobs=None if data.get("logprobs") is None else tuple(
                    None if lp is None else float(lp) for lp in data["logprobs"]),
                top=None if top is None else tuple(
                    None if entries is None else tuple(
                        TopEntry(str(e[0]), float(e[1]), int(e[2]) if len(e) > 2 and e[2] is not None else None)
                        for e in entries)
                    for entries in top),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"malformed token trace: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class Divergence:
    """Where and how a run's output left the baseline's.

    ``position``: the first differing token's index (None: the tokens agree but the texts differ);
    ``baseline_token`` / ``other_token``: the two tokens there (None: that run had ended);
    ``baseline_logprob``: the baseline's log-prob of its own token; ``other_logprob``: the baseline's log-prob of
    the other run's token (None: not in its top-N, or no log-probs); ``gap``: their difference, a lower bound when
    the token was not listed; ``drift`` / ``drift_position``: the largest difference of the two runs' log-probs of
    the same token and where (None: the other run reported no log-probs); ``*_next``: up to
    :data:`CONTEXT_TOKENS` tokens of each run from ``position`` on."""

    kind: Kind
    position: int | None
    baseline_token: str | None
    other_token: str | None
    baseline_logprob: float | None
    other_logprob: float | None
    gap: float | None
    margin: float
    reason: str
    baseline_next: tuple[str, ...] = ()
    other_next: tuple[str, ...] = ()
    drift: float | None = None
    drift_position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, "baseline_token": self.baseline_token,
                "other_token": self.other_token, "baseline_logprob": self.baseline_logprob,
                "other_logprob": self.other_logprob, "gap": self.gap, "margin": self.margin, "reason": self.reason,
                "baseline_next": list(self.baseline_next), "other_next": list(self.other_next),
                "drift": self.drift, "drift_position": self.drift_position}

    def warning(self, task: str) -> str:
        """The loud one-line report of a real divergence (or a near-tie's note)."""
        head = "REAL DIVERGENCE" if self.kind == "real" else "near-tie"
        if self.position is None:
            return f"{head} in {task}: {self.reason}"
        drift = "" if self.drift is None else f", drift {self.drift:.3g} at token {self.drift_position}"
        return (f"{head} in {task} at token {self.position}: baseline {_show(self.baseline_next)} (log-prob "
                f"{_lp(self.baseline_logprob)}) vs {_show(self.other_next)} (baseline log-prob "
                f"{_lp(self.other_logprob)}{drift}); {self.reason}")


def _show(tokens: Sequence[str]) -> str:
    return repr("".join(tokens)) if tokens else "<end>"


def _lp(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def first_difference(baseline: TokenTrace, other: TokenTrace) -> int | None:
    """The first index where the traces' tokens differ (by id when both carry ids, else by string); the shorter
    one's length when one is a prefix of the other; None when they are equal."""
    a: Sequence[Any] = baseline.token_ids if baseline.token_ids is not None and other.token_ids is not None \
        else baseline.tokens
    b: Sequence[Any] = other.token_ids if baseline.token_ids is not None and other.token_ids is not None \
        else other.tokens
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(baseline: TokenTrace, other: TokenTrace, *, margin: float = DEFAULT_NEAR_TIE_MARGIN,
             texts_differ: bool = True) -> Divergence | None:
    """Classify ``other``'s departure from ``baseline`` at the first differing token; None when they agree.

    ``texts_differ``: the two outputs' texts differ (the caller's byte comparison). When the tokens agree but the
    texts do not, the difference is not the model's (detokenization, stop handling) and is reported as real."""
    margin = check_margin(margin)
    k = first_difference(baseline, other)
    if k is None:
        if not texts_differ:
            return None
        return Divergence("real", None, None, None, None, None, None, margin,
                          "the texts differ although every token agrees: detokenization or stop handling differs")
    base_tok = baseline.tokens[k] if k < len(baseline.tokens) else None
    other_tok = other.tokens[k] if k < len(other.tokens) else None
    base_lp = baseline.logprobs[k] if baseline.logprobs is not None and base_tok is not None else None
    context = (tuple(baseline.tokens[k:k + CONTEXT_TOKENS]), tuple(other.tokens[k:k + CONTEXT_TOKENS]))

    drift, drift_at = log_prob_drift(baseline, other, k)

    def real(reason: str, other_lp: float | None = None, gap: float | None = None) -> Divergence:
        return Divergence("real", k, base_tok, other_tok, base_lp, other_lp, gap, margin, reason, *context,
                          drift, drift_at)

    if base_tok is None:
        return real("the baseline ended here while the other run went on; the baseline reported no distribution "
                    "at this position, so no margin can be shown")
    if other_tok is None:
        return real("the other run ended here while the baseline went on; its end token was not reported, so no "
                    "margin can be shown")
    entries = baseline.top[k] if baseline.top is not None else None
    if base_lp is None or not entries:
        return real("the baseline has no log-probs at this position (request its top log-probs)")
    use_ids = other.token_ids is not None and all(e.token_id is not None for e in entries)
    key = other.token_ids[k] if use_ids and other.token_ids is not None else other_tok
    listed = [e.logprob for e in entries if (e.token_id if use_ids else e.token) == key]
    if not listed:
        lowest = min(e.logprob for e in entries)
        bound = base_lp - lowest
        return real(f"{other_tok!r} is not among the baseline's top {len(entries)} here: its log-prob is below "
                    f"{lowest:.4f}, a gap of at least {bound:.4f} nats (margin {margin})", gap=bound)
    other_lp = max(listed)
    gap = base_lp - other_lp
    if other.logprobs is not None and other.logprobs[k] is not None:
        own = abs(other.logprobs[k] - other_lp)  # the two runs' log-probs of the other run's token at k
        if drift is None or own > drift:
            drift, drift_at = own, k
    if abs(gap) > margin:
        return real(f"gap {gap:.4f} nats > margin {margin}: more than rounding of the logits explains", other_lp, gap)
    if drift is not None and drift > margin:
        return real(f"gap {gap:.4f} nats is within the margin, but the runs' log-probs of the same token differ by "
                    f"{drift:.4g} nats at token {drift_at} (> margin {margin}): they do not compute the same "
                    "distribution", other_lp, gap)
    return Divergence("near_tie", k, base_tok, other_tok, base_lp, other_lp, gap, margin,
                      f"gap {gap:.4f} nats <= margin {margin}: rounding of the logits can flip it", *context,
                      drift, drift_at)


def log_prob_drift(baseline: TokenTrace, other: TokenTrace, k: int | None = None) -> tuple[float | None, int | None]:
    """The largest ``|other - baseline|`` log-prob of the same token over positions ``0 .. k-1`` (all positions when
    ``k`` is None: the traces must then agree token for token) and where; ``(None, None)`` when either run has no
    log-probs there."""
    if k is None:
        k = len(baseline.tokens)
    if baseline.logprobs is None or other.logprobs is None:
        return None, None
    best: tuple[float | None, int | None] = (None, None)
    for j, (a, b) in enumerate(zip(baseline.logprobs[:k], other.logprobs[:k], strict=False)):
        if a is not None and b is not None and (best[0] is None or abs(a - b) > best[0]):
            best = (abs(a - b), j)
    return best


__all__ = ["CONTEXT_TOKENS", "DEFAULT_NEAR_TIE_MARGIN", "FP32_NEAR_TIE_MARGIN", "TOP_LOGPROBS", "Divergence", "TokenTrace", "TopEntry",
           "check_margin", "classify", "first_difference", "log_prob_drift"]
