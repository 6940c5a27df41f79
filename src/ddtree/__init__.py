"""ddtree: lossless tree speculative decoding with DFlash block-diffusion drafters, and the lab that tunes it.

Parts (each a subpackage): ``speculative`` (trees, verification, KV compaction as batched tensor ops), ``models``
(targets and DFlash drafters loaded from real checkpoints), ``engine`` (continuous batching of AR, DFlash-chain
and DDTree requests), ``server`` (OpenAI-compatible HTTP), ``lab`` (bench, coding gate, sweeps, reports, replay)
and ``train`` (the embedded demo pair's training code).
"""

from ddtree.errors import (
    CheckpointError,
    ConfigError,
    DDTreeError,
    EngineError,
    InvalidRequestError,
    QueueFullError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DDTreeError",
    "EngineError",
    "InvalidRequestError",
    "QueueFullError",
    "__version__",
]
