"""``ddtree replay``: one greedy trace predicts acceptance for every budget and top-k, in seconds.

:func:`record_trace` runs the target's greedy continuation and records the drafter's per-depth marginals at every
position a round could start from; :func:`predict` rebuilds the trees the engine would build there with
``ddtree.speculative`` and walks them along the continuation. See :mod:`ddtree.lab.replay.trace` for the format.
"""

from ddtree.lab.replay.predict import Prediction, Setting, predict, settings_grid
from ddtree.lab.replay.trace import TRACE_SCHEMA, Trace, record_trace

__all__ = ["TRACE_SCHEMA", "Prediction", "Setting", "Trace", "predict", "record_trace", "settings_grid"]
