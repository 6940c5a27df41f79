"""``ddtree.speculative``: one speculative round's bookkeeping as batched tensor ops (no host sync, no node loops).

Data flow of a round: draft logits -> :func:`build_trees` (or :func:`build_chain`) -> target forward with
:func:`tree_positions`, :func:`tree_write_positions`, :func:`build_attention_mask` -> :func:`sample_choices` ->
:func:`walk_trees` -> :func:`compact_cache`.
"""

from ddtree.speculative.attention import (
    additive_mask,
    build_attention_mask,
    causal_visibility,
    tree_positions,
    tree_write_positions,
)
from ddtree.speculative.compaction import compact_cache
from ddtree.speculative.sampling import counter_uniform, sample_choices
from ddtree.speculative.tree import Trees, build_chain, build_trees
from ddtree.speculative.walk import WalkResult, walk_trees

__all__ = [
    "Trees",
    "WalkResult",
    "additive_mask",
    "build_attention_mask",
    "build_chain",
    "build_trees",
    "causal_visibility",
    "compact_cache",
    "counter_uniform",
    "sample_choices",
    "tree_positions",
    "tree_write_positions",
    "walk_trees",
]
