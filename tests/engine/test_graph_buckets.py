"""The CUDA-graph buckets of a round's sizes (pure host arithmetic, no GPU): a round may be padded up, never cut."""

from __future__ import annotations

from ddtree.engine.cuda_graphs import bucket_nodes, bucket_rows


def test_node_buckets_cover_the_budget_and_never_add_a_row_past_the_next_power_of_two():
    for budget in range(1, 2049):
        nodes = bucket_nodes(budget)
        power = 1 << (budget - 1).bit_length()  # the previous rule: budgets rounded up to a power of two
        assert budget <= nodes <= power
        # A verify carries the nodes plus the root: budgets below a power of two fill exactly that many rows.
        assert nodes + 1 == (power + 1 if budget == power else power)


def test_node_buckets_are_few():
    assert bucket_nodes(0) == 0  # plain decoding: no tree
    assert sorted({bucket_nodes(b) for b in range(1, 129)}) == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128]


def test_row_buckets_are_powers_of_two_capped_at_the_batch():
    assert [bucket_rows(r, 8) for r in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert bucket_rows(5, 6) == 6
