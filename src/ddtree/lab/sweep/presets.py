"""Named sweeps.

``seed`` reproduces the users' campaign (the user story's knobs, their context x concurrency matrix and their
5-task coding gate), with two repeats per cell because their short-prompt runs varied by ~15% from run to run.

``demo`` is that campaign scaled to the embedded demo pair on a 2-core CPU (the sweep itself within five minutes,
report included; ``docs/benchmarks.md`` has the measured times). It keeps what makes the answer interesting and
what the demo pair can show: a short prompt (64 tokens) and a long one (512), answers of 128 tokens (enough rounds
for acceptance to mean something: with 64 the first rounds, which accept least, weigh too much), three budgets
(4, 16, 64: the largest pays at batch 1 and not at batch 4), two concurrency levels, two repeats (so margins are
judged against the measured spread), and the 5-task coding gate, whose answers stop at the end of the function and
whose real purpose on a model this small (it never writes a working body) is the lossless check against AR. No
warm-up runs: on a CPU nothing is captured or compiled on first use. The draft window is left at the whole
context: at these lengths it is a knob of memory, not of speed (a sweep over ``--window 64,none`` showed it).
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
        budgets=(4, 16, 64),
        topks=(None,),
        block_sizes=(None,),
        draft_windows=(None,),
        contexts=(64, 512),
        concurrency=(1, 4),
        output_tokens=128,
        num_requests=4,
        repeats=2,
        prompt_text="code",
        warmup=False,
        gate_tasks=None,  # the bench's fixed 5-task GATE_TASKS
        gate_max_tokens=128,
    ),
}


def get_preset(name: str) -> SweepConfig:
    """The preset called ``name``; a :class:`ConfigError` lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown sweep preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None


__all__ = ["PRESETS", "get_preset"]
