"""What the scheduler's loop holds between its steps: a round queued on the device and not yet read (:class:`Flight`),
first tokens sampled on the device and not yet read (:class:`FirstTokens`), and the small rules over a round's
request states that its steps share (:mod:`ddtree.engine.scheduler`, :mod:`ddtree.engine.prefill_steps`,
:mod:`ddtree.engine.follow_ups`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.engine.api import TokenLogprob
from ddtree.engine.request_state import Phase, RequestState
from ddtree.engine.round import PackedRows, RoundShape
from ddtree.engine.runner import HostCopy, StageTimer

# The host's stand-in for a first token still on the device (FirstTokens), in the tokens a launch takes as read but
# not committed: never a token id, so no stop rule matches it (its row's root is patched on the device).
UNREAD = -1

# One row's share of a round read on the host: its state, the tokens it commits, their log-probs (None unless asked).
RowResult = tuple["RequestState", list[int], "list[TokenLogprob] | None"]


@dataclass
class FirstTokens:
    """First completion tokens sampled on the device by a prefill step (or a mixed round's chunk) and not read on
    the host yet: the rows join the next round at once, their roots patched on the device
    (:meth:`ddtree.engine.scheduler.Scheduler._launch`, ``_follow_up``), and the tokens are read and emitted at the
    top of a later loop iteration, before that round is read.

    Why: reading them in the prefill step made the host wait for the round in flight and the prefill, then build
    the next round while the device idled; at 64 in flight requests arrive about every round (the H200 stand-in:
    3.6 ms a round past the device stages for DDTree b4, 0.3 ms for AR, whose requests arrive once a wave)."""

    states: list[RequestState]  # in the order of ``tokens``
    tokens: torch.Tensor  # [D] long, device
    copy: HostCopy  # ``tokens``' copy to the host, started when they were sampled
    started: float  # perf_counter at the start of the prefill step (the rows' prefill stage time ends at the read)
    # the queued round (Flight.seq) whose prompt chunk sampled them (a mixed round), None: a prefill step's. Those
    # of the round in flight are read once it is read, not at the top of the next iteration (which would make the
    # host wait for that round before queuing the next one)
    round_seq: int | None = None


@dataclass
class Flight:
    """A round queued on the device whose result the host has not read yet."""

    states: list[RequestState]  # the rows, in order
    result: torch.Tensor  # [R, 2 + L] device: tokens committed, then the tokens (ModelRunner.round)
    copy: HostCopy  # the result's copy to the host, started when the round was queued
    rows: PackedRows  # the round's device inputs (a follow-up round advances them)
    shape: RoundShape
    timer: StageTimer
    explores: bool = False  # budget auto ran a size above its best to observe it (AutoChooser.choose)
    riders: list[RequestState] = field(default_factory=list)  # a mixed round's prefilling requests (_launch)
    seq: int = 0  # the round's number (Scheduler._rounds_queued when it was queued)


def live_rows(flight: Flight) -> list[RequestState]:
    """The rows of ``flight`` whose requests still decode, in order (the others finished or were cancelled since it
    was queued)."""
    return [s for s in flight.states if s.phase is Phase.DECODE]


def holds(states: list[RequestState], state: RequestState) -> bool:
    """Whether ``state`` itself is in ``states`` (identity: states are dataclasses, and equality compares fields)."""
    return any(s is state for s in states)


# The fields of a RoundShape that its rows' settings decide (row_flags): a follow-up's joiners must keep them.
ROW_FLAGS = ("greedy", "filtered", "contiguous", "logprobs", "min_tokens")


def row_flags(states: list[RequestState]) -> dict[str, bool]:
    """The :data:`ROW_FLAGS` of a round of ``states``."""
    return {"greedy": all(s.sampling.greedy for s in states), "filtered": any_filter(states),
            "contiguous": all(s.tree.method != "ddtree" for s in states),
            "logprobs": any(s.sampling.logprobs is not None for s in states),
            "min_tokens": any(bool(s.banned_ids) for s in states)}


def any_filter(states: list[RequestState]) -> bool:
    return any(s.sampling.top_p < 1.0 or s.sampling.top_k > 0 for s in states if not s.sampling.greedy)


def describe_current_exception() -> str:
    import sys

    exc = sys.exc_info()[1]
    return f"{type(exc).__name__}: {exc}"

