"""What an engine reports about itself (``Engine.info()``, the server's ``/server_info``): versions, device, the
configuration and limits, the KV cache, and what start-up did (warm-up, exact mode's check, the cost curve)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddtree.engine.api import TreeSettings

if TYPE_CHECKING:
    from ddtree.engine.engine import Engine


def engine_info(engine: Engine) -> dict[str, Any]:
    """A JSON-ready description of a built ``engine`` (started or not)."""
    import transformers

    from ddtree import __version__

    cfg = engine.config
    return {
        "model": engine.model_name,
        "versions": {"ddtree": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "device": str(engine.device),
        "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "dtype": cfg.dtype,
        "config": {k: (v.to_dict() if isinstance(v, TreeSettings) else v) for k, v in cfg.__dict__.items()},
        "defaults": engine.defaults.to_dict(),
        "limits": {
            "max_batch": cfg.max_batch,
            "max_len": cfg.max_len,
            "max_budget": cfg.max_budget,
            "max_block_size": engine.max_block_size,
            "trained_block_size": engine.trained_block_size if engine.drafter is not None else None,
        },
        "kv_cache": {
            "slots": cfg.max_batch,
            "tokens_per_slot": engine.cache_len,
            "capacity_tokens": cfg.max_batch * cfg.max_len,
            "bytes": engine.runner.kv_bytes,
        },
        "drafter": engine.drafter is not None,
        "warmup": engine.parts.warmup.info(),
        "exact": engine.parts.exact_info(),
        "cost_curve": engine.cost_curve_source.info(),
    }

