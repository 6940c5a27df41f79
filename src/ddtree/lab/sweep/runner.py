"""``run_sweep``: measure every config of a grid, cell by cell, resumably, then write the report.

Three ways to reach an engine, one measurement path (HTTP, through ``run_bench`` and ``run_humaneval``):

inprocess (default)
    one :class:`~ddtree.engine.Engine` loaded once for the whole sweep, served by the real ``ddtree.server`` app on
    a loopback port; each config is just a different ``{"ddtree": {...}}`` in the request body.
url
    a ``ddtree serve`` already running; settings per request as above.
launch
    an external engine started per config from a command template (SGLang, vLLM, ``ddtree serve`` with
    flags), see :mod:`ddtree.lab.sweep.launcher`; the settings are in the command line, not in the requests.

The loop, per config: skip cells already finished on disk; start (or reuse) the engine; run each pending cell; write
it atomically, or write a failure record for it and go on. AR comes first so its greedy gate outputs exist when the
speculative configs' gates are compared against them (the lossless check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shlex
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console

from ddtree.errors import ConfigError, DDTreeError
from ddtree.lab.sweep.cells import CellFailed, resolve_gate_tasks, run_bench_cell, run_gate
from ddtree.lab.sweep.grid import LaunchSpec, SweepConfig, SweepPoint, max_int_budget
from ddtree.lab.sweep.launcher import LaunchedServer, LaunchError, free_port, stop_stale
from ddtree.lab.sweep.layout import GATE_CELL, RunLayout, atomic_write_json, bench_cell_name, read_json
from ddtree.lab.sweep.manifest import Manifest
from ddtree.lab.sweep.profiles import LaunchCommand
from ddtree.lab.sweep.target import Endpoint, SweepTarget
from ddtree.lab.sweep.templates import render_template

if TYPE_CHECKING:
    from ddtree.engine import Engine
    from ddtree.engine.config import EngineConfig

def sized_engine_config(config: SweepConfig, base: EngineConfig | None = None, **explicit: Any) -> EngineConfig:
    """An :class:`EngineConfig` whose preallocated limits fit the whole grid.

    ``max_len`` covers the longest context plus the output, and a HumanEval prompt (at most ~1k tokens with any
    tokenizer we ship) plus the gate's answer; ``max_budget`` and ``max_block_size`` cover the grid's largest;
    ``max_batch`` defaults to the highest concurrency so C=64 is measured as 64 requests decoding together.
    ``explicit`` values (from CLI flags) win."""
    from ddtree.engine.config import EngineConfig

    base = base or EngineConfig()
    gate_len = (1024 + config.gate_max_tokens) if config.gate_tasks != () else 0
    needed_len = max(max(config.contexts) + config.output_tokens, gate_len) + 16
    blocks = [b for b in config.block_sizes if b is not None]
    sized = dataclasses.replace(
        base,
        max_len=max(base.max_len, needed_len) if explicit.get("max_len") is None else explicit["max_len"],
        max_budget=max(base.max_budget, max_int_budget(config.budgets)),
        max_block_size=max([*blocks, base.max_block_size or 0]) or None,
        max_batch=max(config.concurrency) if explicit.get("max_batch") is None else explicit["max_batch"],
    )
    return sized.validated()


# ------------------------------------------------------------------------------------------------ endpoints
class Backend(Protocol):
    """How configs reach an engine: ``serve(point)`` yields the endpoint for one config; ``close()`` at the end."""

    load_s: float | None  # seconds the one in-process engine took to load and warm up (None elsewhere)

    def serve(self, point: SweepPoint, layout: RunLayout) -> contextlib.AbstractContextManager[Endpoint]: ...

    def close(self) -> None: ...


class _InProcessBackend:
    """One engine and one HTTP server for the whole sweep, started on first use (a fully finished resume loads
    nothing)."""

    def __init__(self, target: SweepTarget, config: SweepConfig, engine: Engine | None, console: Console) -> None:
        self.target = target
        self.config = config
        self.console = console
        self._engine = engine
        self._owns_engine = engine is None
        self._server: Any = None
        self._gate_engine: Any = None  # exact mode's engine for the gate, on the sweep engine's models
        self._gate_server: Any = None
        self.load_s: float | None = None

    def _ensure(self) -> None:
        if self._server is not None:
            return
        from ddtree.server.app import create_app
        from ddtree.server.threaded import ThreadedServer

        if self._engine is None:
            from ddtree.engine import Engine

            engine_config = self.target.engine_config or sized_engine_config(self.config)
            self.console.print(f"loading the engine ({engine_config.target or 'the embedded demo pair'}) ...")
            started = time.monotonic()
            self._engine = Engine.from_config(engine_config)
            self._engine.start()
            self.load_s = time.monotonic() - started
        elif not self._engine.ready:
            self._engine.start()
        self._server = ThreadedServer(create_app(self._engine))
        self._server.start()

    @contextlib.contextmanager
    def serve(self, point: SweepPoint, layout: RunLayout) -> Iterator[Endpoint]:
        self._ensure()
        assert self._engine is not None
        if point.budget == "auto":  # its cost curve, measured once before the first timed cell (not inside it)
            self._engine.prepare_auto()
        server = self._server
        yield Endpoint(
            url=server.url,
            engine="ddtree",
            model=self._engine.model_name,
            extra_body={**self.target.extra_body, "ddtree": point.tree_settings()},
            alive=server.alive,
            tokenizer=self._engine.tokenizer,
        )

    def gate_endpoint(self, point: SweepPoint) -> Endpoint:
        """The lossless gate's endpoint: our engine in exact mode (``EngineConfig.exact``), so that any difference
        from AR is a real bug. The sweep's engine itself when it is exact already; else a second engine on the same
        models (shared weights, its own small KV cache for the gate's requests) behind its own loopback server."""
        self._ensure()
        assert self._engine is not None
        if self._engine.config.exact:
            server, engine = self._server, self._engine
        else:
            if self._gate_engine is None:
                from ddtree.engine import Engine
                from ddtree.lab.sweep.cells import GATE_CONCURRENCY
                from ddtree.server.app import create_app
                from ddtree.server.threaded import ThreadedServer

                config = dataclasses.replace(self._engine.config, exact=True, max_batch=GATE_CONCURRENCY,
                                             kv_memory_fraction=None, warmup="none")
                self.console.print("starting the gate's engine in exact mode ...")
                self._gate_engine = Engine(self._engine.target, self._engine.drafter, self._engine.tokenizer,
                                           config, model_name=self._engine.model_name)
                self._gate_engine.start()
                self._gate_server = ThreadedServer(create_app(self._gate_engine))
                self._gate_server.start()
            server, engine = self._gate_server, self._gate_engine
            if engine.cost_curve is None:  # budget "auto": the sweep engine's curve (outputs matter here, not speed)
                engine.cost_curve = self._engine.cost_curve
        return Endpoint(url=server.url, engine="ddtree", model=engine.model_name,
                        extra_body={**self.target.extra_body, "ddtree": point.tree_settings()}, alive=server.alive,
                        tokenizer=engine.tokenizer)

    def close(self) -> None:
        if self._gate_server is not None:
            self._gate_server.stop()
            self._gate_server = None
        if self._gate_engine is not None:
            self._gate_engine.shutdown(drain_timeout=5.0)
            self._gate_engine = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._owns_engine and self._engine is not None:
            self._engine.shutdown(drain_timeout=5.0)
            self._engine = None


class _UrlBackend:
    """A ddtree server that is already running: every config is the same URL with other tree settings."""

    def __init__(self, target: SweepTarget) -> None:
        self.target = target
        self.load_s: float | None = None

    @contextlib.contextmanager
    def serve(self, point: SweepPoint, layout: RunLayout) -> Iterator[Endpoint]:
        assert self.target.url is not None
        engine = "ddtree" if self.target.engine == "auto" else self.target.engine
        yield Endpoint(
            url=self.target.url,
            engine=engine,
            model=self.target.model,
            extra_body={**self.target.extra_body, "ddtree": point.tree_settings()},
        )

    def close(self) -> None:
        pass


class _LaunchBackend:
    """One launched server per config (the settings are in its command line, not in the requests)."""

    def __init__(self, target: SweepTarget, config: SweepConfig) -> None:
        self.target = target
        self.config = config
        self.profile = config.profile
        if config.launch is not None:
            self.launch = config.launch
        else:
            assert self.profile is not None
            self.launch = LaunchSpec(command="(engine profile)", ready_timeout_s=self.profile.ready_timeout_s,
                                     stop_timeout_s=self.profile.stop_timeout_s)
        self.load_s: float | None = None

    def command_for(self, point: SweepPoint, port: int) -> str:
        return self.launch_command(point, port).display

    def launch_command(self, point: SweepPoint, port: int) -> LaunchCommand:
        """The profile's rendering of ``point``, or the ``--launch`` template's (which sets no environment)."""
        if self.profile is not None:
            return self.profile.command(point, port, self.config)
        values = {k: v for k, v in point.template_values().items() if v is not None}
        values.update(port=str(port), config_id=point.config_id)
        return LaunchCommand(tuple(shlex.split(render_template(self.launch.template_for(point.method), values))))

    def stop_orphans(self, layout: RunLayout, points: list[SweepPoint], console: Console) -> None:
        """Stop servers an earlier, killed session launched and could not stop (they hold ports and GPU memory)."""
        for point in points:
            record = (read_json(layout.config_path(point.config_id)) or {}).get("launch") or {}
            if record.get("stop_signal") is None and stop_stale(record, self.launch.stop_timeout_s):
                layout.log_event("orphan_stopped", config_id=point.config_id, pid=record.get("pid"))
                console.print(f"stopped a server left running by an earlier session: {point.config_id} "
                              f"(pid {record.get('pid')})")

    @contextlib.contextmanager
    def serve(self, point: SweepPoint, layout: RunLayout) -> Iterator[Endpoint]:
        port = self.launch.port or free_port(self.target.host)
        command = self.launch_command(point, port)
        _update_config_json(layout, point, command=command.to_dict())
        server = LaunchedServer(
            shlex.join(command.argv),
            env={**os.environ, **dict(command.env)} if command.env else None,
            port=port,
            host=self.target.host,
            log_path=layout.log_path(point.config_id),
            ready_timeout_s=self.launch.ready_timeout_s,
            stop_timeout_s=self.launch.stop_timeout_s,
            model=self.target.model,
            on_start=lambda record: _update_config_json(layout, point, launch=record.to_dict()),
        )
        try:
            with server:
                yield Endpoint(
                    url=server.url,
                    engine=self.target.engine,
                    model=self.target.model or server.record.served_model,
                    extra_body=dict(self.target.extra_body),
                    launch=server.record,
                    alive=server.alive,
                )
        finally:
            _update_config_json(layout, point, launch=server.record.to_dict())

    def close(self) -> None:
        pass


def _baseline_point(point: SweepPoint) -> SweepPoint:
    return SweepPoint("ar", dims=point.dims)


def pending_cells(
    layout: RunLayout, config: SweepConfig, point: SweepPoint, gate_tasks: tuple[str, ...]
) -> list[str]:
    """Cell names of ``point`` still to measure: missing, failed, or (gate) compared with no AR baseline although
    one exists now."""
    cid = point.config_id
    cells = [bench_cell_name(c, n) for c, n in config.bench_cells() if not layout.bench_done(cid, c, n)]
    if gate_tasks:
        if not layout.eval_done(cid):
            cells.append(GATE_CELL)
        elif point.method != "ar":
            gate = read_json(layout.eval_path(cid)) or {}
            if gate.get("lossless") is None and layout.eval_done(_baseline_point(point).config_id):
                cells.append(GATE_CELL)
    return cells


def _update_config_json(layout: RunLayout, point: SweepPoint, **fields: Any) -> None:
    path = layout.config_path(point.config_id)
    data = read_json(path) or {}
    data.update({"point": point.to_dict(), "tree_settings": point.tree_settings(), **fields})
    atomic_write_json(path, data)


# ------------------------------------------------------------------------------------------------ the sweep
@dataclass
class SweepOutcome:
    run_dir: Path
    status: str  # "finished", "finished-with-failures", "interrupted"
    cells_run: int
    cells_skipped: int
    cells_failed: int
    report: Path | None


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread, so launched servers are stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _plan(config: SweepConfig, target: SweepTarget) -> dict[str, Any]:
    """The exact command per config for the manifest (ports filled in at launch time: see each config.json)."""
    from ddtree.lab.sweep.profiles import build_plan

    engine_config = target.engine_config
    return build_plan(config, target=engine_config.target if engine_config else None,
                      draft=engine_config.draft if engine_config else None).to_dict()


def _make_backend(target: SweepTarget, config: SweepConfig, engine: Engine | None, console: Console) -> Backend:
    launched = config.launch is not None or (config.profile is not None and config.profile.engine != "ddtree")
    if target.mode == "launch" or launched:
        if not launched:
            raise ConfigError("mode launch needs a launch template (--launch) or --engine sglang|vllm with --model")
        return _LaunchBackend(target, config)
    if engine is not None and target.mode != "inprocess":
        raise ConfigError("an engine object can only be swept in-process")
    if target.mode == "url":
        return _UrlBackend(target)
    return _InProcessBackend(target, config, engine, console)


def run_sweep(
    config: SweepConfig,
    target: SweepTarget,
    run_dir: str | Path,
    *,
    resume: bool = False,
    engine: Engine | None = None,
    console: Console | None = None,
    report: bool = True,
    slo: Mapping[str, float] | None = None,
) -> SweepOutcome:
    """Measure ``config`` against ``target`` into ``run_dir`` and write the report there.

    ``resume`` continues a run directory: finished cells are skipped, failed and missing ones are run. ``engine``
    (in-process only) sweeps an engine the caller already built instead of loading one. ``slo`` (latency limits,
    see :mod:`ddtree.lab.report.latency`) is kept in the manifest for the report's goodput."""
    console = console or Console(stderr=True)
    layout = RunLayout(Path(run_dir))
    gate_tasks = resolve_gate_tasks(config)
    backend = _make_backend(target, config, engine, console)  # config errors surface before anything is written
    manifest = Manifest.open(layout, config, target.describe(), resume=resume)
    manifest.data["plan"] = _plan(config, target)
    if slo:
        manifest.data["slo"] = dict(slo)
    manifest.save()
    points = config.points()
    total = len(points) * (len(config.bench_cells()) + (1 if gate_tasks else 0))
    counts = {"run": 0, "skipped": 0, "failed": 0}
    status = "interrupted"

    @functools.cache
    def tokenizer() -> Any:
        """The served model's tokenizer for url/launch modes, loaded once (not once per cell)."""
        from ddtree.lab.bench import load_tokenizer

        return load_tokenizer(target.tokenizer)[0]

    console.print(f"sweep {layout.root}: {len(points)} configs, {total} cells ({target.mode})")
    try:
        with _sigterm_as_interrupt():
            if isinstance(backend, _LaunchBackend) and resume:
                backend.stop_orphans(layout, points, console)
            for index, point in enumerate(points, 1):
                cid = point.config_id
                pending = pending_cells(layout, config, point, gate_tasks)
                skipped = total // len(points) - len(pending)
                counts["skipped"] += skipped
                manifest.count("skipped", skipped)
                if not pending:
                    layout.log_event("config_skipped", config_id=cid)
                    continue
                _update_config_json(layout, point)
                console.print(f"[bold][{index}/{len(points)}] {cid}[/bold]: {len(pending)} cell(s) to run")
                _run_point(layout, manifest, backend, target, config, point, pending, gate_tasks, counts, console,
                           tokenizer)
                if backend.load_s is not None and "engine_load_s" not in manifest.session:
                    manifest.set_global_timing("engine_load_s", backend.load_s)
        status = "finished-with-failures" if counts["failed"] else "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except BaseException:
        status = "error"
        raise
    finally:
        backend.close()
        manifest.finish(status)
        layout.log_event("sweep_end", status=status, **counts)
    report_path = None
    if report:
        from ddtree.lab.report import write_report

        paths = write_report(layout.root)
        report_path = paths.summary
        console.print(f"report: {paths.summary} and {paths.html}")
    return SweepOutcome(layout.root, status, counts["run"], counts["skipped"], counts["failed"], report_path)


def _run_point(
    layout: RunLayout,
    manifest: Manifest,
    backend: Backend,
    target: SweepTarget,
    config: SweepConfig,
    point: SweepPoint,
    pending: list[str],
    gate_tasks: tuple[str, ...],
    counts: dict[str, int],
    console: Console,
    tokenizer: Callable[[], Any],
) -> None:
    cid = point.config_id
    cells = {bench_cell_name(c, n): (c, n) for c, n in config.bench_cells()}
    try:
        with backend.serve(point, layout) as endpoint:
            if endpoint.tokenizer is None and any(name != GATE_CELL for name in pending):
                endpoint.tokenizer = tokenizer()
            layout.clear_failure(cid, "launch")
            if endpoint.launch is not None:
                manifest.config_timing(cid, load_to_ready_s=endpoint.launch.load_to_ready_s)
                _update_config_json(layout, point, launch=endpoint.launch.to_dict())
                console.print(f"  ready in {endpoint.launch.load_to_ready_s:.1f} s ({endpoint.launch.verified})")
            for name in pending:
                if not endpoint.alive():
                    _fail(layout, manifest, counts, cid, name, "crash", "the server process exited during the sweep",
                          console)
                    continue
                started, t0 = time.time(), time.monotonic()
                layout.log_event("cell_start", config_id=cid, cell=name)
                try:
                    if name == GATE_CELL:
                        baseline = layout.eval_path(_baseline_point(point).config_id)
                        use = baseline if point.method != "ar" and layout.eval_done(baseline.parent.name) else None
                        exact = config.gate_exact and isinstance(backend, _InProcessBackend)  # our engine: exact
                        gate_at = backend.gate_endpoint(point) if exact else endpoint
                        result = run_gate(target, gate_at, config, gate_tasks, use, exact=exact)
                        atomic_write_json(layout.eval_path(cid), result)
                        lossless = result.get("lossless") or {}
                        summary = f"{result.get('passed')}/{result.get('total')} passed" + (
                            f", lossless {lossless.get('identical')}/{lossless.get('compared')} identical, "
                            f"{lossless.get('near_tie', 0)} near-tie, {lossless.get('real', 0)} real"
                            if lossless else ""
                        )
                        from rich.markup import escape

                        from ddtree.lab.humaneval.lossless import warning_lines

                        for line in warning_lines(lossless):  # real ones are logged as warnings by the gate
                            if not line.startswith("REAL"):
                                console.print(f"  {escape(line)}", highlight=False)
                    else:
                        ctx, conc = cells[name]
                        cell = run_bench_cell(target, endpoint, config, point, ctx, conc)
                        atomic_write_json(layout.bench_path(cid, ctx, conc), cell)
                        s = cell.get("summary") or {}
                        acc = s.get("accept_length")
                        summary = f"{s.get('output_tok_s', 0):.1f} tok/s" + (f", accept {acc:.2f}" if acc else "")
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # recorded per cell: the sweep goes on (see the module docstring)
                    kind = exc.kind if isinstance(exc, CellFailed) else type(exc).__name__
                    data = exc.data if isinstance(exc, CellFailed) else None
                    _fail(layout, manifest, counts, cid, name, kind, _describe(exc), console, data=data)
                    continue
                duration = time.monotonic() - t0
                layout.clear_failure(cid, name)
                layout.log_event("cell_done", config_id=cid, cell=name, duration_s=duration)
                manifest.cell_timing(cid, name, started, duration)
                manifest.count("run")
                counts["run"] += 1
                console.print(f"  {name}: {summary} ({duration:.1f} s)")
    except LaunchError as exc:
        record = {"kind": "launch", "error": str(exc), "log": str(layout.log_path(cid)), "cells": pending}
        layout.record_failure(cid, "launch", record)
        layout.log_event("launch_failed", config_id=cid, error=str(exc)[:500])
        manifest.count("failed")
        counts["failed"] += 1
        console.print(f"  [red]launch failed[/red]: {str(exc).splitlines()[0]}")


def _fail(
    layout: RunLayout,
    manifest: Manifest,
    counts: dict[str, int],
    cid: str,
    cell: str,
    kind: str,
    error: str,
    console: Console,
    data: dict[str, Any] | None = None,
) -> None:
    record: dict[str, Any] = {"kind": kind, "error": error}
    if data is not None:
        record["data"] = data
    log = layout.log_path(cid)
    if log.is_file():
        record["log"] = str(log)
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-20:]
    layout.record_failure(cid, cell, record)
    layout.log_event("cell_failed", config_id=cid, cell=cell, kind=kind, error=error[:500])
    manifest.count("failed")
    counts["failed"] += 1
    console.print(f"  [red]{cell} failed[/red] ({kind}): {error.splitlines()[0][:200] if error else ''}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DDTreeError):
        return str(exc)
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]).strip()


__all__ = [
    "CellFailed",
    "Endpoint",
    "SweepOutcome",
    "SweepTarget",
    "pending_cells",
    "resolve_gate_tasks",
    "run_sweep",
    "sized_engine_config",
]
