"""A model config's sizes are checked where it is made: a broken checkpoint's config.json fails with the field named,
not later inside a forward with a reshape error."""

from __future__ import annotations

import dataclasses

import pytest

from ddtree.errors import ConfigError
from ddtree.models.config import DrafterConfig, TargetConfig

TARGET = dict(family="qwen3", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              intermediate_size=64)
DRAFTER = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
               vocab_size=64, block_size=4, mask_token_id=1, target_layer_ids=(0,))


@pytest.mark.parametrize("cls, base", [(TargetConfig, TARGET), (DrafterConfig, DRAFTER)], ids=["target", "drafter"])
@pytest.mark.parametrize("change, message", [
    ({"num_heads": 3}, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    ({"head_dim": 7}, "head_dim must be even for RoPE, got 7"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"num_kv_heads": True}, "num_kv_heads must be a positive integer, got True"),
    ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer, got -1"),
])
def test_config_refuses_a_broken_shape_naming_the_field(cls, base, change, message):
    cls(**base)  # the base is valid
    with pytest.raises(ConfigError, match=message):
        cls(**{**base, **change})


def test_the_two_configs_check_the_same_fields():
    """What both configs hold is checked alike (one rule, ``config._check_shape`` over ``config._SIZES``)."""
    shared = {f.name for f in dataclasses.fields(TargetConfig)} & {f.name for f in dataclasses.fields(DrafterConfig)}
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "max_position_embeddings"):
        assert name in shared
        for cls, base in ((TargetConfig, TARGET), (DrafterConfig, DRAFTER)):
            with pytest.raises(ConfigError, match=name):
                cls(**{**base, name: 0})
