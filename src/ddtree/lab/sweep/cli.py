"""``ddtree sweep`` and ``ddtree report``: flags -> :class:`SweepConfig` + :class:`SweepTarget` -> :func:`run_sweep`.

Flags override the preset or config file they start from; lists are comma-separated and ``none`` means "no cap /
trained size / whole context" where the knob allows it. ``register(app)`` adds both commands.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import typer

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options
from ddtree.errors import ConfigError
from ddtree.lab.sweep.grid import LaunchSpec, SweepConfig, parse_budgets, parse_dim, parse_list
from ddtree.lab.sweep.layout import RunLayout, read_json
from ddtree.lab.sweep.presets import PRESETS, get_preset
from ddtree.lab.sweep.profiles import PROFILE_ENGINES, EngineProfile


def build_config(
    *,
    preset: str | None = None,
    config_file: Path | None = None,
    methods: str | None = None,
    budgets: str | None = None,
    topks: str | None = None,
    block_sizes: str | None = None,
    draft_windows: str | None = None,
    dims: list[str] | None = None,
    contexts: str | None = None,
    concurrency: str | None = None,
    output_tokens: int | None = None,
    num_requests: int | None = None,
    repeats: int | None = None,
    seed: int | None = None,
    text: str | None = None,
    gate_tasks: str | None = None,
    gate_max_tokens: int | None = None,
    gate_exact: bool | None = None,
    launch: str | None = None,
    launch_ar: str | None = None,
    launch_dflash: str | None = None,
    launch_timeout: float | None = None,
    stop_timeout: float | None = None,
    port: int | None = None,
    profile: EngineProfile | None = None,
) -> SweepConfig:
    """The sweep the flags describe: the preset or config file (not both), then every flag given on top.

    ``profile`` (``--engine sglang|vllm|ddtree --model M``) replaces a launch template."""
    if preset and config_file:
        raise ConfigError("give either --preset or --config, not both (flags can refine either)")
    base = get_preset(preset) if preset else SweepConfig.from_file(config_file) if config_file else SweepConfig()
    changes: dict[str, Any] = {}
    if methods is not None:
        changes["methods"] = tuple(m.strip() for m in methods.split(",") if m.strip())
    if budgets is not None:
        changes["budgets"] = parse_budgets(budgets)
    if topks is not None:
        changes["topks"] = parse_list(topks, what="topk", optional=True)
    if block_sizes is not None:
        changes["block_sizes"] = parse_list(block_sizes, what="block-size", optional=True)
    if draft_windows is not None:
        changes["draft_windows"] = parse_list(draft_windows, what="draft-window", optional=True)
    if dims:
        changes["dims"] = tuple(parse_dim(d) for d in dims)
    if contexts is not None:
        changes["contexts"] = parse_list(contexts, what="contexts")
    if concurrency is not None:
        changes["concurrency"] = parse_list(concurrency, what="concurrency")
    if gate_tasks is not None:
        tasks = tuple(t.strip() for t in gate_tasks.split(",") if t.strip())
        changes["gate_tasks"] = () if tasks in ((), ("none",)) else tasks
    changes.update(output_tokens=output_tokens, num_requests=num_requests, repeats=repeats, seed=seed,
                   gate_max_tokens=gate_max_tokens, gate_exact=gate_exact, prompt_text=text)
    spec = base.launch
    if launch is not None or (spec is not None and any(v is not None for v in (launch_ar, launch_dflash,
                                                                                 launch_timeout, stop_timeout, port))):
        if launch is None and spec is None:
            raise ConfigError("--launch-ar/--launch-dflash/--launch-timeout/--port need --launch")
        fields = spec.to_dict() if spec else {}
        if launch is not None:
            fields["command"] = launch
        for key, value in (("ar", launch_ar), ("dflash", launch_dflash), ("ready_timeout_s", launch_timeout),
                           ("stop_timeout_s", stop_timeout), ("port", port)):
            if value is not None:
                fields[key] = value
        spec = LaunchSpec(**fields)
        changes["launch"] = spec
    elif profile is not None and launch_ar is None and launch_dflash is None:
        if launch_timeout is not None or stop_timeout is not None:
            profile = dataclasses.replace(profile, ready_timeout_s=launch_timeout or profile.ready_timeout_s,
                                          stop_timeout_s=stop_timeout or profile.stop_timeout_s)
        if port is not None:
            raise ConfigError("--port goes with --launch; an engine profile passes --port itself")
    elif any(v is not None for v in (launch_ar, launch_dflash, launch_timeout, stop_timeout, port)):
        raise ConfigError("--launch-ar/--launch-dflash/--launch-timeout/--stop-timeout/--port need --launch")
    if profile is not None:
        if spec is not None:
            raise ConfigError("give either --launch (a template) or --engine with --model (a profile), not both")
        changes["profile"] = profile
    return base.replace(**changes)  # one step: dims and launch are validated together


def default_run_name(config: SweepConfig) -> str:
    return f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def latest_run(out: Path, name: str | None) -> Path | None:
    """The most recently created run under ``out`` (whose grid is called ``name``, unless ``None``)."""
    best: tuple[float, Path] | None = None
    if not out.is_dir():
        return None
    for child in out.iterdir():
        manifest = read_json(RunLayout(child).manifest_path) if child.is_dir() else None
        if isinstance(manifest, dict) and name in (None, (manifest.get("grid") or {}).get("name")):
            created = float(manifest.get("created") or 0.0)
            if best is None or created > best[0]:
                best = (created, child)
    return best[1] if best else None


def register(app: typer.Typer) -> None:
    """Add ``sweep``, ``report`` and the ``replay`` sub-app (one call wires all three)."""
    from ddtree.lab.replay.cli import register as register_replay

    app.command("sweep")(sweep)
    app.command("report")(report)
    register_replay(app)


# The in-process engine's flags (--target, --draft, --device, --dtype, --max-batch, --max-len, --cuda-graphs, ...)
# come from EngineConfig (ddtree.engine.options); --seed stays the workload's, and max_batch / max_len default to fit
# the grid (sized_engine_config).
@engine_options(exclude=("seed",), defaults={"max_batch": None, "max_len": None})
def sweep(
    preset: str | None = typer.Option(None, help=f"Named sweep: {', '.join(PRESETS)} (seed = the users' campaign)."),
    config: Path | None = typer.Option(None, "--config", help="Sweep file (.toml; .yaml with PyYAML) with grid, dims, bench, gate and launch sections."),
    method: str | None = typer.Option(None, help="Methods beyond the always-included baselines (ar, dflash), e.g. ddtree."),
    budget: str | None = typer.Option(None, help="Tree budgets, e.g. 4,8,12,16 (auto: chosen per round)."),
    topk: str | None = typer.Option(None, help="Top-k caps per depth, e.g. 4,6,8 or none."),
    block_size: str | None = typer.Option(None, help="Block sizes, e.g. 8,16 (none = the drafter's trained size)."),
    draft_window: str | None = typer.Option(None, help="Draft windows, e.g. 2048,none."),
    dim: list[str] | None = typer.Option(None, help="Extra launch-template dimension NAME=V1,V2 (repeatable), e.g. tp=1,8."),
    contexts: str | None = typer.Option(None, help="Prompt lengths in tokens, e.g. 60,1024,4096,8192."),
    concurrency: str | None = typer.Option(None, help="Concurrency levels, e.g. 1,8,32,64."),
    output_tokens: int | None = typer.Option(None, help="Output tokens per request (ignore_eos)."),
    num_requests: int | None = typer.Option(None, help="Requests per cell (default: the bench's, >= 2 x concurrency)."),
    repeats: int | None = typer.Option(None, help="Runs per cell; 2 or more measure the run-to-run spread."),
    seed: int | None = typer.Option(None, help="Workload seed."),
    text: str | None = typer.Option(None, help="Prompt filler: words (English) or code (held-out stdlib Python)."),
    gate_tasks: str | None = typer.Option(None, help="HumanEval task ids for the coding gate, or none to skip it."),
    gate_max_tokens: int | None = typer.Option(None, help="Answer length limit of the coding gate."),
    gate_exact: bool | None = typer.Option(None, "--gate-exact/--no-gate-exact", help="Run the gate on our in-process "
                                           "engine in exact mode, where any difference from AR is a bug (default "
                                           "on); off: the divergence classifier tells near-ties from real ones."),
    url: str | None = typer.Option(None, help="A running ddtree server to sweep (settings per request)."),
    launch: str | None = typer.Option(None, help="Command template started per config, e.g. \"ddtree serve --port {port} --budget {budget}\"."),
    launch_ar: str | None = typer.Option(None, help="Template for the AR baseline (default: --launch)."),
    launch_dflash: str | None = typer.Option(None, help="Template for the DFlash baselines (default: --launch)."),
    launch_timeout: float | None = typer.Option(None, help="Seconds a launched server has to become ready (default 900)."),
    stop_timeout: float | None = typer.Option(None, help="Seconds between SIGTERM and SIGKILL of a launched server (default 30)."),
    port: int | None = typer.Option(None, help="Port of launched servers whose template has no {port}."),
    engine: str = typer.Option("auto", help="sglang, vllm or ddtree: with --model, launch that engine per config "
                               "with its own flags (a profile); behind --url/--launch: the engine kind (auto detects)."),
    model: str | None = typer.Option(None, help="With --engine: the target model path or hub id; else the served "
                                     "model name (default: the first of /v1/models)."),
    engine_args: str | None = typer.Option(None, help="With --engine: extra flags appended to every launch, e.g. "
                                           "\"--mem-fraction-static 0.8\"."),
    engine_opt: list[str] | None = typer.Option(None, help="With --engine: a profile switch KEY=VALUE (repeatable), "
                                                "e.g. tree_verify=on or block_flag=dflash-block-size (SGLang)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (every config's label and exact command) "
                                 "and exit; nothing is launched or written."),
    slo: str | None = typer.Option(None, help="Latency limits for goodput, e.g. ttft_ms=500,itl_ms=50 (also e2e_ms); "
                                   "recommendations then rank on requests/s meeting them."),
    endpoint: str = typer.Option("completions", help="completions or chat."),
    tokenizer: str | None = typer.Option(None, help="The served model's tokenizer for exact prompt lengths."),
    extra_body: str | None = typer.Option(None, help="JSON object merged into every request body."),
    api_key: str | None = typer.Option(None, help="Bearer token for the server."),
    request_timeout: float = typer.Option(600.0, help="Seconds per request before it counts as failed."),
    out: Path = typer.Option(Path("results"), help="Directory that holds run directories."),
    run: str | None = typer.Option(None, help="Run directory name under --out (default: <preset>-<date>-<time>)."),
    resume: bool = typer.Option(False, help="Continue a run: skip finished cells, re-run failed ones."),
    no_report: bool = typer.Option(False, "--no-report", help="Do not write the report at the end."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Measure tree settings (plus AR and DFlash baselines) on a context x concurrency matrix, then report."""
    from ddtree.lab.sweep.runner import SweepTarget, run_sweep, sized_engine_config

    target, draft = engine_config.target, engine_config.draft
    profile = None
    if model is not None and engine in PROFILE_ENGINES and url is None and launch is None:
        profile = EngineProfile.build(engine, model, draft, extra_args=engine_args, options=engine_opt)
        if engine == "ddtree":  # settings per request: the pair runs in process, loaded once
            target, model = model, None
        else:
            model = None  # the launched server names its model (/v1/models)
    elif engine_args is not None or engine_opt:
        raise ConfigError("--engine-args/--engine-opt need --engine sglang|vllm|ddtree with --model")
    slo_limits = parse_slo(slo) if slo else None
    grid_flags = (preset, config, method, budget, topk, block_size, draft_window, dim, contexts, concurrency,
                  output_tokens, num_requests, repeats, seed, text, gate_tasks, gate_max_tokens, gate_exact, launch,
                  launch_ar,
                  launch_dflash, launch_timeout, stop_timeout, port)
    cfg = build_config(
        preset=preset, config_file=config, methods=method, budgets=budget, topks=topk, block_sizes=block_size,
        draft_windows=draft_window, dims=dim, contexts=contexts, concurrency=concurrency,
        output_tokens=output_tokens, num_requests=num_requests, repeats=repeats, seed=seed, text=text,
        gate_tasks=gate_tasks, gate_exact=gate_exact,
        gate_max_tokens=gate_max_tokens, launch=launch, launch_ar=launch_ar, launch_dflash=launch_dflash,
        launch_timeout=launch_timeout, stop_timeout=stop_timeout, port=port, profile=profile,
    )
    if dry_run:
        from ddtree.lab.sweep.labels import config_labels
        from ddtree.lab.sweep.profiles import build_plan

        plan = build_plan(cfg, target=target, draft=draft)
        for line in plan.lines(config_labels(cfg.points())):
            typer.echo(line)
        return
    bare = all(v in (None, []) for v in (*grid_flags, profile))  # no grid flag: a bare --resume continues the stored grid
    if run is None:
        run_dir = latest_run(out, None if bare else cfg.name) if resume else out / default_run_name(cfg)
        if run_dir is None:
            raise ConfigError(f"--resume found no sweep run under {out}" + ("" if bare else f" named {cfg.name!r}")
                              + "; pass --run NAME")
    else:
        run_dir = out / run
    stored = read_json(RunLayout(run_dir).manifest_path) if resume else None
    if isinstance(stored, dict) and bare:
        cfg = SweepConfig.from_dict(stored["grid"])
    try:
        body = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"--extra-body must be a JSON object, got {extra_body!r}")
    if url and cfg.launch is not None:
        raise ConfigError("give either --url (a running server) or --launch (one server per config), not both")
    launched = cfg.launch is not None or (cfg.profile is not None and cfg.profile.engine != "ddtree")
    mode = "launch" if launched else "url" if url else "inprocess"
    if cfg.profile is not None and engine == "auto":
        engine = cfg.profile.engine
    sized = None
    if mode == "inprocess":
        # max_batch / max_len not given: None here, sized to the grid by sized_engine_config
        base = dataclasses.replace(engine_config, target=target, max_batch=EngineConfig.max_batch,
                                   max_len=EngineConfig.max_len)
        sized = sized_engine_config(cfg, base, max_batch=engine_config.max_batch, max_len=engine_config.max_len)
    sweep_target = SweepTarget(
        mode=mode, url=url, engine=engine, model=model, endpoint=endpoint, tokenizer=tokenizer,  # type: ignore[arg-type]
        extra_body=body, api_key=api_key, timeout_s=request_timeout, engine_config=sized,
    )
    outcome = run_sweep(cfg, sweep_target, run_dir, resume=resume, report=not no_report, slo=slo_limits)
    typer.echo(
        f"{outcome.status}: {outcome.cells_run} cells run, {outcome.cells_skipped} skipped, "
        f"{outcome.cells_failed} failed -> {outcome.run_dir}"
    )
    if outcome.report is not None:
        typer.echo(f"summary: {outcome.report}")


def report(
    run_dir: Path = typer.Argument(..., help="A run directory written by `ddtree sweep` (results/<run>)."),
    slo: str | None = typer.Option(None, help="Latency limits for goodput, e.g. ttft_ms=500,itl_ms=50 (default: "
                                   "the ones the sweep was given)."),
) -> None:
    """Write summary.md, report.html and plots/ for a sweep run (finished, interrupted or in progress)."""
    from ddtree.lab.report import write_report

    paths = write_report(run_dir, slo=parse_slo(slo) if slo else None)
    typer.echo(f"{paths.summary}\n{paths.html}")
    for path in paths.plots.values():
        typer.echo(str(path))


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft_ms=500,itl_ms=50"`` -> ``{"ttft_ms": 500.0, "itl_ms": 50.0}`` (see :mod:`ddtree.lab.report.latency`)."""
    from ddtree.lab.report.latency import SLO_KEYS

    limits: dict[str, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo expects KEY=MS with KEY one of {', '.join(SLO_KEYS)}, got {item.strip()!r}")
        try:
            limit = float(value)
        except ValueError:
            raise ConfigError(f"--slo {key}: {value.strip()!r} is not a number of milliseconds") from None
        if not limit > 0:
            raise ConfigError(f"--slo {key} must be > 0 ms, got {value.strip()}")
        limits[key] = limit
    if not limits:
        raise ConfigError("--slo needs at least one limit, e.g. ttft_ms=500")
    return limits


__all__ = ["build_config", "default_run_name", "latest_run", "parse_slo", "register"]
