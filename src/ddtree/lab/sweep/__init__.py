"""``ddtree sweep``: measure a grid of tree settings (plus the AR and DFlash baselines) on a context x concurrency
matrix with a coding gate, resumably, against an in-process engine, a running server or a server launched per
configuration, and end with the report (:mod:`ddtree.lab.report`).

Public API::

    SweepConfig, SweepPoint, LaunchSpec          the grid (grid.py), PRESETS / get_preset (presets.py)
    SweepTarget, run_sweep, SweepOutcome         the campaign (runner.py)
    RunLayout, atomic_write_json                 the results directory (layout.py)
    LaunchedServer, LaunchError                  one launched engine (launcher.py)
"""

from ddtree.lab.sweep.grid import LaunchSpec, SweepConfig, SweepPoint
from ddtree.lab.sweep.launcher import LaunchedServer, LaunchError
from ddtree.lab.sweep.layout import RunLayout, atomic_write_json
from ddtree.lab.sweep.presets import PRESETS, get_preset
from ddtree.lab.sweep.runner import SweepOutcome, SweepTarget, run_sweep, sized_engine_config

__all__ = [
    "PRESETS",
    "LaunchError",
    "LaunchSpec",
    "LaunchedServer",
    "RunLayout",
    "SweepConfig",
    "SweepOutcome",
    "SweepPoint",
    "SweepTarget",
    "atomic_write_json",
    "get_preset",
    "run_sweep",
    "sized_engine_config",
]
