"""The lab: instruments that measure a served configuration (``bench``, the ``humaneval`` coding gate) and the
sweeps and reports built on them.

Public entry points for scripts and the sweep::

    from ddtree.lab import BenchTarget, Workload, run_bench, run_humaneval, GATE_TASKS
"""

from ddtree.lab.bench import Workload, run_bench
from ddtree.lab.client import BenchTarget
from ddtree.lab.humaneval import GATE_TASKS, run_humaneval

__all__ = ["GATE_TASKS", "BenchTarget", "Workload", "run_bench", "run_humaneval"]
