"""``manifest.json``: what was measured, with what, where, and when.

A run directory's manifest holds the grid (so ``--resume`` can refuse a changed grid and ``ddtree report`` knows the
intended order of configs), the target (in-process engine, URL or launch template), and one *session* per
invocation (``ddtree sweep`` then each ``--resume``) with the versions, hardware and git revision of that session,
its cell counts and timings. Timings per config (load to ready, seconds per cell) sit under ``timings``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.lab.sweep.grid import SweepConfig
from ddtree.lab.sweep.layout import MANIFEST_SCHEMA, RunLayout, atomic_write_json, read_json

_PACKAGES = ("ddtree", "torch", "triton", "transformers", "tokenizers", "fastapi", "uvicorn", "httpx", "numpy")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict[str, Any]:
    """CPU model and count, memory, and the CUDA devices torch sees (names and memory)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "memory_gib": None,
        "gpus": [],
    }
    mem = _proc_field("/proc/meminfo", "MemTotal")
    if mem and mem.split()[0].isdigit():
        info["memory_gib"] = round(int(mem.split()[0]) / 2**20, 1)
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                info["gpus"].append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    except ImportError:  # torch is a dependency; a broken install still gets a manifest
        info["cuda"] = None
    return info


def git_revision() -> dict[str, Any] | None:
    """The commit of the ddtree source tree this runs from (read-only ``git`` calls), or ``None`` outside git."""
    source = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()), "path": str(source)}


def environment() -> dict[str, Any]:
    return {"versions": versions(), "hardware": hardware(), "git": git_revision(), "argv": sys.argv}


def _proc_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


class Manifest:
    """The manifest of one run, rewritten atomically whenever it changes (it is small)."""

    def __init__(self, layout: RunLayout, data: dict[str, Any]) -> None:
        self.layout = layout
        self.data = data

    @classmethod
    def open(
        cls, layout: RunLayout, config: SweepConfig, target: dict[str, Any], *, resume: bool
    ) -> Manifest:
        """Create the run's manifest, or continue it (``resume``) after checking the grid has not changed."""
        existing = read_json(layout.manifest_path)
        if existing is not None and not resume:
            raise ConfigError(
                f"{layout.root} already holds a sweep; pass --resume to continue it, or choose another --run"
            )
        if existing is None and resume and layout.root.exists() and any(layout.root.iterdir()):
            raise ConfigError(f"{layout.root} has no readable manifest.json; it is not a sweep run to resume")
        if existing is not None:
            stored = SweepConfig.from_dict(existing["grid"])
            if stored != config:
                diff = sorted(k for k, v in config.to_dict().items() if stored.to_dict().get(k) != v)
                raise ConfigError(
                    f"--resume with a different grid than {layout.root} was started with (differs in: "
                    f"{', '.join(diff)}); resume with the same settings, or start another --run"
                )
            data = existing
        else:
            data = {
                "schema": MANIFEST_SCHEMA,
                "run": layout.root.name,
                "created": time.time(),
                "grid": config.to_dict(),
                "configs": [p.config_id for p in config.points()],
                "points": [p.to_dict() for p in config.points()],
                "target": target,
                "sessions": [],
                "timings": {},
            }
        data["sessions"].append(
            {
                "started": time.time(),
                "finished": None,
                "status": "running",
                "resumed": existing is not None,
                "target": target,
                "environment": environment(),
                "cells": {"run": 0, "skipped": 0, "failed": 0},
            }
        )
        layout.create()
        manifest = cls(layout, data)
        manifest.save()
        return manifest

    @classmethod
    def load(cls, layout: RunLayout) -> Manifest | None:
        data = read_json(layout.manifest_path)
        return cls(layout, data) if isinstance(data, dict) else None

    @property
    def session(self) -> dict[str, Any]:
        return self.data["sessions"][-1]

    def save(self) -> None:
        atomic_write_json(self.layout.manifest_path, self.data)

    def count(self, what: str, n: int = 1) -> None:
        self.session["cells"][what] += n

    def set_global_timing(self, key: str, value: Any) -> None:
        self.session[key] = value
        self.save()

    def config_timing(self, config_id: str, **fields: Any) -> None:
        self.data["timings"].setdefault(config_id, {"cells": {}}).update(fields)
        self.save()

    def cell_timing(self, config_id: str, cell: str, started: float, duration_s: float) -> None:
        entry = self.data["timings"].setdefault(config_id, {"cells": {}})
        entry.setdefault("cells", {})[cell] = {"started": started, "duration_s": duration_s}
        self.save()

    def finish(self, status: str) -> None:
        self.session["finished"] = time.time()
        self.session["status"] = status
        self.save()


__all__ = ["Manifest", "environment", "git_revision", "hardware", "versions"]
