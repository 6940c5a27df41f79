"""Device and dtype names from the command line and configs, resolved once at the edge."""

from __future__ import annotations

import torch

from ddtree.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU; asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu or auto")
    return device


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """A dtype by name; ``auto`` is bf16 on CUDA and fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
