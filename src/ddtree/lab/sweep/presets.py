"""Named sweeps.

``seed`` reproduces the users' campaign (the user story's knobs, their context x concurrency matrix and their
5-task coding gate), with two repeats per cell because their short-prompt runs varied by ~15% from run to run.

``demo`` is that campaign scaled to the embedded demo pair on a 2-core CPU: at most five minutes from a cold
start, report included (about 3 minutes of CPU time measured, see the report of the sweep that tuned it). It keeps
what makes the answer interesting: two budgets (2 and 16), top-k 1 against no cap, a draft window of 16 against
the whole context, two contexts and two concurrency levels (so latency, throughput and long context each get a
winner), two repeats (so margins are judged against the measured spread), and a two-task coding gate whose real
purpose on a model this small is the lossless check against AR.
"""

from __future__ import annotations

from ddtree.errors import ConfigError
from ddtree.lab.sweep.grid import SweepConfig

PRESETS: dict[str, SweepConfig] = {
    "seed": SweepConfig(
        name="seed",
        methods=("ddtree",),
        budgets=(4, 8, 12, 16),
        topks=(4, 6, 8),
        block_sizes=(8, 16),
        draft_windows=(2048, None),
        contexts=(60, 1024, 4096, 8192),
        concurrency=(1, 8, 32, 64),
        output_tokens=256,
        repeats=2,
        gate_tasks=None,  # the bench's fixed 5-task GATE_TASKS
        gate_max_tokens=1024,
    ),
    "demo": SweepConfig(
        name="demo",
        methods=("ddtree",),
        budgets=(2, 16),
        topks=(1, None),
        block_sizes=(None,),
        draft_windows=(16, None),
        contexts=(32, 256),
        concurrency=(1, 4),
        output_tokens=16,
        num_requests=4,
        repeats=2,
        prompt_text="code",
        gate_tasks=("HumanEval/0", "HumanEval/2"),
        gate_max_tokens=32,
    ),
}


def get_preset(name: str) -> SweepConfig:
    """The preset called ``name``; a :class:`ConfigError` lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown sweep preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None


__all__ = ["PRESETS", "get_preset"]
