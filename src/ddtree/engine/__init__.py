"""The engine: continuous batching of AR, DFlash-chain and DDTree requests over one loaded target and drafter."""

from ddtree.engine.api import (
    GenerationOutput,
    GenerationRequest,
    RequestStats,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
    TreeSettings,
)
from ddtree.engine.config import EngineConfig


def __getattr__(name: str):
    # The engine pulls in the model code; import it lazily so the light API types stay cheap to import.
    if name in ("Engine", "EngineSnapshot"):
        from ddtree.engine import engine as _engine

        return getattr(_engine, name)
    raise AttributeError(name)


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineSnapshot",
    "GenerationOutput",
    "GenerationRequest",
    "RequestStats",
    "SamplingParams",
    "StreamChunk",
    "TokenLogprob",
    "TreeSettings",
]
