"""The results directory of one sweep run, and the atomic writes that keep it readable after a kill.

::

    results/<run>/
        manifest.json                 versions, hardware, git revision, the grid, timings (one entry per session)
        events.jsonl                  one line per cell start/finish/failure, appended (the audit trail of resumes)
        summary.md, report.html, plots/*.png      written by ``ddtree report``
        configs/<config_id>/
            config.json               the point's settings, launch command and load-to-ready time
            bench/ctx{c}-c{n}.json    one benchmark cell (``ddtree.bench.cell/1``)
            humaneval.json            the coding gate (``ddtree.eval.humaneval/2``; ``/1`` still read)
            failure.json              {cell name: failure record} for cells that failed (removed when they pass)
            server.log                stdout + stderr of a launched engine

A cell is *finished* when its JSON file exists and parses with the expected schema; anything else (missing, a
failure record, a truncated file left by a kill before the rename) is run again by ``--resume``. Every JSON file
is written to a temporary file in the same directory, flushed to disk and renamed over the target, so a reader
sees either the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.files import atomic_write_bytes, atomic_write_json, atomic_write_text, finite_json

BENCH_SCHEMA = "ddtree.bench.cell/1"
EVAL_SCHEMA = "ddtree.eval.humaneval/2"  # the same string as ddtree.lab.humaneval.EVAL_SCHEMA
EVAL_SCHEMAS = ("ddtree.eval.humaneval/1", EVAL_SCHEMA)  # /1: no token traces, no divergence classes
MANIFEST_SCHEMA = "ddtree.sweep.manifest/1"
FAILURE_SCHEMA = "ddtree.sweep.failure/1"
GATE_CELL = "humaneval"


def read_json(path: Path) -> Any | None:
    """The parsed file, or ``None`` when it is missing or not valid JSON (treated as "not done")."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def bench_cell_name(context: int, concurrency: int) -> str:
    return f"ctx{context}-c{concurrency}"


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory; creating it is explicit (:meth:`create`), reading never writes."""

    root: Path

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    def config_dir(self, config_id: str) -> Path:
        return self.configs_dir / config_id

    def config_path(self, config_id: str) -> Path:
        return self.config_dir(config_id) / "config.json"

    def bench_path(self, config_id: str, context: int, concurrency: int) -> Path:
        return self.config_dir(config_id) / "bench" / f"{bench_cell_name(context, concurrency)}.json"

    def eval_path(self, config_id: str) -> Path:
        return self.config_dir(config_id) / "humaneval.json"

    def failure_path(self, config_id: str) -> Path:
        return self.config_dir(config_id) / "failure.json"

    def log_path(self, config_id: str) -> Path:
        return self.config_dir(config_id) / "server.log"

    def config_ids(self) -> list[str]:
        """Config directories present on disk (sorted; the manifest's grid gives the measured order)."""
        if not self.configs_dir.is_dir():
            return []
        return sorted(p.name for p in self.configs_dir.iterdir() if p.is_dir())

    def create(self) -> None:
        self.configs_dir.mkdir(parents=True, exist_ok=True)

    # --------------------------------------------------------------------------------------- cell state
    def bench_done(self, config_id: str, context: int, concurrency: int) -> bool:
        data = read_json(self.bench_path(config_id, context, concurrency))
        return isinstance(data, dict) and data.get("schema") == BENCH_SCHEMA

    def eval_done(self, config_id: str) -> bool:
        data = read_json(self.eval_path(config_id))
        return isinstance(data, dict) and data.get("schema") in EVAL_SCHEMAS

    def failures(self, config_id: str) -> dict[str, Any]:
        data = read_json(self.failure_path(config_id))
        return dict(data.get("cells", {})) if isinstance(data, dict) else {}

    def record_failure(self, config_id: str, cell: str, record: Mapping[str, Any]) -> None:
        """Add or replace the failure record of one cell (``"launch"`` for a config that never came up)."""
        cells = self.failures(config_id)
        cells[cell] = {"time": time.time(), **record}
        atomic_write_json(self.failure_path(config_id), {"schema": FAILURE_SCHEMA, "cells": cells})

    def clear_failure(self, config_id: str, cell: str) -> None:
        """Forget a cell's failure once it has passed (the file goes when no failure is left)."""
        cells = self.failures(config_id)
        if cell not in cells:
            return
        del cells[cell]
        if cells:
            atomic_write_json(self.failure_path(config_id), {"schema": FAILURE_SCHEMA, "cells": cells})
        else:
            self.failure_path(config_id).unlink(missing_ok=True)

    # --------------------------------------------------------------------------------------- events
    def log_event(self, event: str, **fields: Any) -> None:
        """Append one JSON line. Appends are not atomic: a line cut short by a kill is ended before the next one
        is written and skipped by :meth:`events`, so it never hides the complete lines around it."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps(finite_json({"time": time.time(), "event": event, **fields}), allow_nan=False)
        with self.events_path.open("a+b") as fh:
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line cut short by a kill: end it so ours stays whole
                    line = "\n" + line
            fh.write((line + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def events(self) -> Iterator[dict[str, Any]]:
        if not self.events_path.is_file():
            return
        for line in self.events_path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


__all__ = [
    "BENCH_SCHEMA",
    "EVAL_SCHEMA",
    "EVAL_SCHEMAS",
    "FAILURE_SCHEMA",
    "GATE_CELL",
    "MANIFEST_SCHEMA",
    "RunLayout",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "bench_cell_name",
    "read_json",
]
