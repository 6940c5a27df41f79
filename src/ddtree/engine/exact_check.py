"""Exact mode's start-up check: every row count the engine's target forward can run, and which weights pass.

Why here: the row counts follow from the engine's shapes (rows buckets, tree node buckets, the graphed prefill keys
and the eager prefill chunks' padded widths), which the engine side owns; the check itself is
:func:`ddtree.models.exact_blas.check_row_invariance`. A prefill chunk, a decode step, a chain and a tree all
multiply their token rows in one matmul call of ``rows x tokens`` rows, so a weight that passes at every such count
computes a token's K/V and logits the same way in all of them (prefill and decode agree).
"""

from __future__ import annotations

from ddtree.engine.cuda_graphs import bucket_nodes
from ddtree.engine.prefill_budget import eager_steps
from ddtree.engine.warmup import prefill_keys
from ddtree.models import exact_blas
from ddtree.models.exact_forward import layer_weights


def target_row_counts(*, max_batch: int, max_budget: int, max_block: int, prefill_chunk: int, step_tokens: int,
                      prefill_width: int | None, max_len: int) -> list[int]:
    """Every rows x tokens count of one target forward (sorted, distinct):

    - rounds: 1 .. max_batch requests (a superset of the graphed rows buckets) x 1 .. T tokens, T the widest verify
      (AR 1, a chain's block up to ``max_block``, a tree's node bucket of ``max_budget`` plus the root);
    - graphed first prefill chunks: each key's rows bucket x width bucket (``prefill_width`` None: no graphs);
    - eager prefill chunks: r rows x the widest row padded to a multiple of 16, for every step the scheduler makes
      (:func:`ddtree.engine.prefill_budget.step_shapes`: ``prefill_chunk`` a prompt, ``step_tokens`` a step)."""
    widest = max(1, bucket_nodes(max_budget) + 1, max_block)
    counts = {r * t for r in range(1, max_batch + 1) for t in range(1, widest + 1)}
    if prefill_width is not None:
        counts.update(k.rows * k.width for k in prefill_keys(max_batch=max_batch, prefill_chunk=prefill_chunk,
                                                              step_tokens=step_tokens, max_width=prefill_width,
                                                              max_len=max_len))
    counts.update(r * w for r, w in eager_steps(max_batch=max_batch, chunk=prefill_chunk, step_tokens=step_tokens))
    return sorted(counts)


def check_target(target, **shapes: int | None) -> exact_blas.BlasCheck:
    """Run the check on the shapes of the target's layer projections (layer 0's: every layer has the same; the
    fused q/k/v and gate/up matrices where the engine fused them) at :func:`target_row_counts` (keyword arguments).
    The LM head stays on the Triton kernel: at decode widths it is as fast (the H200 tuning run), and checking it at
    every prefill width would cost seconds more at start."""
    return exact_blas.check_row_invariance(layer_weights(target.layers[0]), target_row_counts(**shapes))
