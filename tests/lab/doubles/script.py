"""The acceptance script both doubles follow: which rounds accept how many drafts, and the ground truth of it.

A request of ``n`` completion tokens gets its first token from prefill (as in SGLang and vLLM) and the rest from
verify rounds; round ``r`` of the whole server accepts ``accepted[r % len(accepted)]`` draft tokens and commits
that many plus the bonus token, the last round of a request cut so the request ends at exactly ``n`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Truth:
    """What the double really did since start-up (or since the last reset), for the tests to compare against."""

    tokens: int = 0  # completion tokens, prefill tokens included
    rounds: int = 0
    accepted: int = 0  # accepted draft tokens
    hist: list[int] = field(default_factory=list)  # [n] = rounds that accepted exactly n drafts

    def add(self, accepted: int) -> None:
        self.rounds += 1
        self.accepted += accepted
        self.tokens += accepted + 1
        while len(self.hist) <= accepted:
            self.hist.append(0)
        self.hist[accepted] += 1


@dataclass
class Script:
    accepted: tuple[int, ...] = (3, 1, 0, 2, 3)
    drafts_per_round: int = 7  # proposed draft tokens per round (block size - 1)
    position: int = 0

    def request(self, n: int) -> tuple[list[int], Truth]:
        """Token counts per streamed event (prefill first) and this request's truth."""
        truth = Truth(tokens=1)
        events = [1]
        left = n - 1
        while left > 0:
            accepted = min(self.accepted[self.position % len(self.accepted)], left - 1)
            self.position += 1
            truth.add(accepted)
            events.append(accepted + 1)
            left -= accepted + 1
        return events, truth
