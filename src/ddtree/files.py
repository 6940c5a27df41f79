"""Files ddtree writes: atomically (a killed sweep, benchmark or engine start never leaves a half-written file)
and as strict JSON.

Hand-written because the standard library has no atomic replace-with-fsync helper and the needs are small: a
temporary file in the same directory, fsync, ``os.replace``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is never observed half-written (temp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make results unreadable to colleagues
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Indented JSON (diff-friendly); NaN and infinities become ``null`` so strict readers accept the file."""
    atomic_write_text(path, json.dumps(finite_json(obj), indent=2, allow_nan=False) + "\n")


def finite_json(obj: Any) -> Any:
    """NaN and infinities -> None, recursively (strict JSON has neither)."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj
