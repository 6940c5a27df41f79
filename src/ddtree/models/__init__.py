"""Compact target models (Qwen3 / Qwen2 / Llama) and DFlash drafters with static KV caches.

The engine and the training code use only the names below; see :mod:`ddtree.models.target` for the forward's
visibility contract and :mod:`ddtree.models.drafter` for the drafter's terms.
"""

from ddtree.models.config import DrafterConfig, TargetConfig, default_target_layer_ids
from ddtree.models.drafter import DFlashDrafter, draft_visibility
from ddtree.models.kv_cache import KVCache
from ddtree.models.layers import fuse_projections
from ddtree.models.loading import load_drafter, load_target, resolve_checkpoint, save_drafter, save_target
from ddtree.models.target import TargetModel, TargetOutput
from ddtree.models.tokenizer import load_tokenizer
from ddtree.speculative.attention import TreeVisibility

__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "KVCache",
    "TargetConfig",
    "TargetModel",
    "TargetOutput",
    "TreeVisibility",
    "default_target_layer_ids",
    "draft_visibility",
    "fuse_projections",
    "load_drafter",
    "load_target",
    "load_tokenizer",
    "resolve_checkpoint",
    "save_drafter",
    "save_target",
]
