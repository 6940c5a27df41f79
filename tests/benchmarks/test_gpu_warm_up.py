"""benchmarks/gpu.py's warm-up lengths (ddtree.lab.bench.matrix): run as the cell's closed loop runs them, the batch must pass through every
row bucket the engine captures a round graph for (so no capture happens inside a timed cell)."""

from __future__ import annotations

import pytest

from ddtree.engine.cuda_graphs import bucket_rows
from ddtree.lab.bench.matrix import warm_up_lengths


def _buckets_seen(lengths: list[int], concurrency: int, per_round: int) -> set[int]:
    """Simulate the closed loop: at most ``concurrency`` requests in flight, each committing ``per_round`` tokens
    a round (speculative rounds commit several), the next prompt starting as one finishes."""
    waiting = list(lengths)
    flying: list[int] = [waiting.pop(0) for _ in range(min(concurrency, len(waiting)))]
    seen = set()
    while flying:
        seen.add(bucket_rows(len(flying), concurrency))
        flying = [left - per_round for left in flying]
        finished = sum(left <= 0 for left in flying)
        flying = [left for left in flying if left > 0]
        for _ in range(finished):
            if waiting:
                flying.append(waiting.pop(0))
    return seen


@pytest.mark.parametrize("concurrency", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("per_round", [1, 3, 16])
def test_warm_up_passes_through_every_row_bucket(concurrency, per_round):
    longest = max(24, 16 * concurrency.bit_length())  # what main() asks for at contexts above 60
    lengths = warm_up_lengths(concurrency, longest)
    assert max(lengths) == longest and min(lengths) >= 1
    every = {bucket_rows(n, concurrency) for n in range(1, concurrency + 1)}
    assert _buckets_seen(lengths, concurrency, per_round) == every


def test_one_request_warms_up_with_one_prompt():
    assert warm_up_lengths(1, 256) == [256]
