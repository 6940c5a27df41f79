"""Host time of budget auto's bookkeeping for a batch of 64 auto rows (the H100's C = 64 case), on this machine.

Per round: ``AutoChooser.choose`` twice (a launch and a follow-up check do) and ``read_row`` for every row with a
15-wide reported curve (a b7 round) and a fixed accepted path; the reported curves are made before the timing. Prints
the mean over ``ROUNDS`` rounds (default 300) of each. Usage: ``PYTHONPATH=src python auto_host_64.py [ROUNDS]``."""

import random
import sys
import time

from ddtree.engine import TreeSettings
from ddtree.engine import auto_budget as ab


class Row:
    """The parts of a RequestState the chooser reads and writes."""

    def __init__(self, rid: str) -> None:
        self.request_id, self.auto_seen, self.auto_curve, self.auto_gain = rid, (), (), (0.0, 0.0)
        self.auto_cached, self.tree, self.budget = None, TreeSettings(budget="auto"), 0


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
rng = random.Random(0)
chooser = ab.AutoChooser(32)
rows = [Row(str(i)) for i in range(64)]
cost = {1: 0.0112, 3: 0.0124, 7: 0.0157, 15: 0.0250, 31: 0.0444}.__getitem__  # the H100 curve at 64 rows, 64 keys
reported = [[tuple(sorted(1 + rng.random() * 5 for _ in range(15))) for _ in rows] for _ in range(rounds + 1)]
path = [0, 1, 2, 4, 6, 9, 11, 13, 14]
for row, curve in zip(rows, reported[-1], strict=True):
    chooser.read_row(row, 4, curve, path, 7)
choose_s = read_s = 0.0
for i in range(rounds):
    t0 = time.perf_counter()
    chooser.choose(rows, cost)
    chooser.choose(rows, cost, explore=False)
    t1 = time.perf_counter()
    for row, curve in zip(rows, reported[i], strict=True):
        chooser.read_row(row, 1 + i % 6, curve, path, 7)
    choose_s += t1 - t0
    read_s += time.perf_counter() - t1
print(f"choose x 2: {choose_s / rounds * 1e3:.3f} ms a round; read_row x 64: {read_s / rounds * 1e3:.3f} ms a round")
