"""What every training step shares: device choice, seeding, the learning-rate schedule and the JSON run log.

The schedule is linear warm-up then cosine decay to ``final_lr_fraction`` of the peak. The number of steps may be
fixed in advance or calibrated once from the measured time of the first steps (``time_budget_s``), so a real run
finishes inside the device machine's 10-minute call limit; the calibrated step count is written to the log, so the
run can be replayed with ``--steps`` exactly.
"""

from __future__ import annotations

import json
import math
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (all devices); returns a CPU generator for the data sampler."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def lr_at(step: int, *, peak: float, warmup: int, total: int, final_fraction: float) -> float:
    """Learning rate at ``step`` (0-based): linear warm-up over ``warmup`` steps, then cosine to the floor."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * final_fraction
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def calibrate_steps(
    *, max_steps: int, seconds_per_step: float, time_budget_s: float | None, elapsed_s: float
) -> int:
    """The step count that fits ``time_budget_s`` (counting ``elapsed_s`` already spent), capped by ``max_steps``."""
    if time_budget_s is None:
        return max_steps
    remaining = max(0.0, time_budget_s - elapsed_s)
    return max(1, min(max_steps, int(remaining / max(seconds_per_step, 1e-9))))


@dataclass
class StepPlan:
    """The number of optimizer steps of a run, fixed up front or calibrated once from the first steps.

    With a ``time_budget_s`` the median time of steps ``2 .. calibration_steps`` (the first pays start-up costs),
    scaled by ``overhead`` for periodic evaluations, sets how many more steps fit; ``max_steps`` caps it. The
    calibration must end inside the warm-up so the learning rates already used do not depend on the result."""

    max_steps: int
    time_budget_s: float | None
    calibration_steps: int
    overhead: float = 1.08
    total: int = 0
    seconds_per_step: float | None = None
    _times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.total = self.max_steps

    def observe(self, step: int, step_seconds: float, elapsed_s: float) -> None:
        """Call after each step (``step`` counted from 1) with its duration and the run's elapsed time."""
        self._times.append(step_seconds)
        if self.time_budget_s is None or step != self.calibration_steps:
            return
        timed = sorted(self._times[1:] or self._times)
        self.seconds_per_step = timed[len(timed) // 2]
        self.total = step + calibrate_steps(
            max_steps=self.max_steps - step, seconds_per_step=self.seconds_per_step * self.overhead,
            time_budget_s=self.time_budget_s, elapsed_s=elapsed_s,
        )


def environment() -> dict[str, Any]:
    """Versions and hardware, for the log and the model card."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # transformers is a hard dependency; absent only in a broken install
        info["transformers"] = None
    import tokenizers

    info["tokenizers"] = tokenizers.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


@dataclass
class RunLog:
    """One JSON file per training step of the pipeline: settings, progress records, results, wall time."""

    path: Path | None
    kind: str
    settings: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def record(self, **values: Any) -> None:
        values["wall_s"] = round(time.perf_counter() - self.started, 3)
        self.records.append(values)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "environment": environment(),
            "settings": self.settings,
            "records": self.records,
            "results": self.results,
            "wall_s": round(self.elapsed(), 3),
        }

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def finish_step(parameters, optimizer: torch.optim.Optimizer, loss: torch.Tensor, *, grad_clip: float,
                plan: StepPlan, log: RunLog, step: int, step_start: float, train_start: float,
                device: torch.device) -> torch.Tensor:
    """The bookkeeping every training loop shares after its forward: backward, clip, step, zero the grads, time
    the step (synchronising CUDA so the plan sees real durations) and record the calibrated plan once.

    ``step`` is the step just finished (counted from 1). Returns the gradient norm before clipping."""
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    plan.observe(step, time.perf_counter() - step_start, time.perf_counter() - train_start)
    if step == plan.calibration_steps:
        log.results["seconds_per_step_calibrated"] = plan.seconds_per_step
        log.results["steps_planned"] = plan.total
    return grad_norm
