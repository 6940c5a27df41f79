"""``ddtree replay record`` (one greedy trace), ``ddtree replay curve`` (a measured cost curve) and ``ddtree replay
predict`` (acceptance for every setting; with a cost curve, tok/s per cell too)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ddtree.engine.config import EngineConfig
from ddtree.engine.options import engine_options
from ddtree.errors import ConfigError

replay_app = typer.Typer(
    help="Predict greedy acceptance for every budget and top-k from one recorded trace.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(replay_app, name="replay")


def read_prompts(path: Path) -> list[str]:
    """Prompts from a JSON-lines file (``prompt`` or ``text`` per line)."""
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc}); write one {{\"prompt\": ...}} per line") from None
        text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{path}:{number}: needs a non-empty \"prompt\" (or \"text\") string")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def _list(text: str, *, what: str, optional: bool) -> tuple[int | None, ...]:
    from ddtree.lab.sweep.grid import parse_list

    return parse_list(text, what=what, optional=optional)


@replay_app.command("record")
# The engine's flags (--target, --draft, --device, --dtype, --max-len, ...) come from EngineConfig; the batch and the
# budget and block limits follow from the prompts, --top-m and --block-size.
@engine_options(exclude=("max_batch", "max_budget", "max_block_size"))
def record(
    out: Path = typer.Option(Path("trace.safetensors"), help="Trace file to write."),
    prompts: Path | None = typer.Option(None, help="JSON-lines prompts ({\"prompt\": ...}); default: the 5 HumanEval gate prompts."),
    max_tokens: int = typer.Option(128, help="Completion tokens per prompt (EOS ignored, like the bench)."),
    block_size: int | None = typer.Option(None, help="Draft block size (default: the drafter's trained size)."),
    draft_window: int | None = typer.Option(None, help="Drafter context window (default: all)."),
    top_m: int = typer.Option(64, help="Tokens kept per depth: the largest budget the trace can predict."),
    from_run: Path | None = typer.Option(None, help="A sweep run directory: record its benchmark cells' own prompts "
                                         "(every cell and repeat, as the bench builds them) at its output length, "
                                         "so `replay predict --run` replays each cell's requests."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Run the target greedily and record the drafter's marginals at every position."""
    from dataclasses import replace

    from ddtree.engine import Engine
    from ddtree.lab.replay.trace import record_trace

    texts: list
    if from_run is not None:
        if prompts is not None:
            raise ConfigError("give --prompts or --from-run, not both")
        from ddtree.lab.bench.workload import load_tokenizer
        from ddtree.lab.replay.throughput import SweepCells

        cells = SweepCells.from_run(from_run)
        per_cell = cells.prompts(load_tokenizer(cells.tokenizer)[0])
        texts = list({tuple(p): p for ps in per_cell.values() for p in ps}.values())
        max_tokens = cells.output_tokens
    elif prompts is not None:
        texts = read_prompts(prompts)
    else:
        from ddtree.lab.humaneval import GATE_TASKS, load_problems

        problems = load_problems()
        texts = [problems[t]["prompt"] for t in GATE_TASKS]
    longest = max((len(t) for t in texts if not isinstance(t, str)), default=0)
    config = replace(engine_config, max_batch=min(8, len(texts)), max_budget=max(64, top_m),
                     max_block_size=block_size,
                     max_len=max(engine_config.max_len, longest + max_tokens + 2 * top_m)).validated()
    engine = Engine.from_config(config)
    engine.start()
    try:
        trace = record_trace(engine, texts, max_tokens, block_size, draft_window, top_m=top_m, out=out)
    finally:
        engine.shutdown(drain_timeout=0)
    meta = trace.metadata()
    typer.echo(f"{out}: {meta['sequences']} sequences, {meta['anchors']} anchors, block {meta['block_size']}, "
               f"window {meta['draft_window'] or 'none'}, top-{meta['top_m']}")


@replay_app.command("predict")
def predict_cmd(
    trace: Path = typer.Argument(..., help="A trace written by `ddtree replay record`."),
    budget: str = typer.Option("2,4,8,16,32,64", help="Budgets to predict; auto (with --cost-curve): budget auto, "
                               "its rounds replayed through the engine's chooser."),
    topk: str = typer.Option("none", help="Top-k caps to predict (none = no cap)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the predictions as JSON here."),
    cost_curve: Path | None = typer.Option(None, help="A cost curve JSON (`ddtree replay curve`): also predict tok/s "
                                           "per setting, context and concurrency."),
    run: Path | None = typer.Option(None, help="With --cost-curve: a sweep run directory; predict its cells (its "
                                    "contexts, concurrency, requests; each cell replays its own prompts when the "
                                    "trace was recorded --from-run) and write predicted.json there for `ddtree "
                                    "report`."),
    contexts: str = typer.Option("64", help="With --cost-curve and no --run: prompt lengths of the cells."),
    concurrency: str = typer.Option("1", help="With --cost-curve and no --run: concurrency levels of the cells."),
    num_requests: int | None = typer.Option(None, help="With --cost-curve and no --run: requests per cell "
                                            "(default: the trace's sequences)."),
    prefill_chunk: int = typer.Option(512, help="With --cost-curve and no --run: the engine's prefill chunk."),
    prefill_step_tokens: int | None = typer.Option(None, help="With --cost-curve and no --run: the engine's "
                                                   "prefill step size (default: the engine's on the curve's device)."),
    prefill_every: int | None = typer.Option(None, min=1, help="With --cost-curve and no --run: the engine's "
                                             "prefill_every (default: the engine's on the curve's device: 3 on CUDA, "
                                             "1 on the CPU)."),
    overlap_rounds: bool | None = typer.Option(None, "--overlap-rounds/--no-overlap-rounds", help="With --cost-curve "
                                               "and no --run: whether the engine queued each round before reading "
                                               "the last (default: the engine's on the curve's device: on with CUDA)."),
    max_budget: int | None = typer.Option(None, help="With budget auto: the engine's max_budget, which bounds "
                                          "auto's sizes (default: the run's engine, else 64)."),
) -> None:
    """Print predicted acceptance length per setting (AR and the DFlash chain included); with --cost-curve also
    predicted tok/s per cell."""
    from rich.console import Console
    from rich.table import Table

    from ddtree.lab.replay.predict import predict
    from ddtree.lab.replay.trace import Trace
    from ddtree.lab.sweep.grid import parse_budgets
    from ddtree.lab.sweep.layout import atomic_write_json

    loaded = Trace.load(trace)
    parsed = parse_budgets(budget)
    budgets = [b for b in parsed if isinstance(b, int)]
    topks = _list(topk, what="topk", optional=True)
    if "auto" in parsed and cost_curve is None:
        raise ConfigError("--budget auto needs --cost-curve: auto's sizes depend on the batch and the round costs, "
                          "so its acceptance is predicted per cell")
    predictions = predict(loaded, budgets, topks)
    chain = next(p.accept_length for p in predictions if p.setting.method == "dflash")
    table = Table(title=f"predicted acceptance ({loaded.model}, block {loaded.block_size}, "
                        f"window {loaded.draft_window or 'none'}, {loaded.num_sequences} sequences x "
                        f"{loaded.max_tokens} tokens)")
    for column in ("setting", "accept length", "rounds", "vs DFlash"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for p in predictions:
        table.add_row(p.setting.label, f"{p.accept_length:.3f}", str(p.rounds),
                      f"{p.accept_length / chain:.2f}x" if chain else "-")
    Console().print(table)
    if json_out is not None:
        atomic_write_json(json_out, {"trace": loaded.metadata(), "predictions": [p.to_dict() for p in predictions]})
    if cost_curve is None:
        if run is not None:
            raise ConfigError("--run needs --cost-curve (tok/s needs the round costs)")
        return
    from ddtree.engine.cost_curve import load_curve
    from ddtree.lab.replay.throughput import (
        PREDICTED_FILE,
        SweepCells,
        cell_sequences,
        predict_cells,
        predicted_document,
    )

    curve = load_curve(cost_curve)
    sequences = None
    if run is not None:
        from ddtree.lab.bench.workload import load_tokenizer

        cells = SweepCells.from_run(run)
        if cells.output_tokens != loaded.max_tokens:
            raise ConfigError(f"the run's requests are {cells.output_tokens} tokens but the trace holds "
                              f"{loaded.max_tokens}; record it with `ddtree replay record --from-run {run}`")
        sequences = cell_sequences([loaded.sequence(s)[0] for s in range(loaded.num_sequences)],
                                   cells.prompts(load_tokenizer(cells.tokenizer)[0]))
        ctxs, concs, reqs, chunk = cells.contexts, cells.concurrency, cells.num_requests, cells.prefill_chunk
        step, every, overlap = cells.prefill_step_tokens, cells.prefill_every, cells.overlap_rounds
        max_budget = cells.max_budget if max_budget is None else max_budget
    else:
        ctxs = tuple(c for c in _list(contexts, what="contexts", optional=False) if c is not None)
        concs = tuple(c for c in _list(concurrency, what="concurrency", optional=False) if c is not None)
        reqs = {c: num_requests or loaded.num_sequences for c in concs}
        chunk, step, every, overlap = prefill_chunk, prefill_step_tokens, prefill_every, overlap_rounds
    auto = None
    if "auto" in parsed:
        from ddtree.lab.replay.auto import auto_anchors

        if len(topks) != 1:
            raise ConfigError("--budget auto takes one --topk (the requests' cap)")
        from ddtree.engine.config import EngineConfig

        auto = auto_anchors(loaded, EngineConfig.max_budget if max_budget is None else max_budget, topks[0])
    cells_out = predict_cells(predictions, curve, depth=loaded.depth, contexts=ctxs, concurrency=concs,
                              num_requests=reqs, max_tokens=loaded.max_tokens, sequences=sequences,
                              prefill_chunk=chunk, step_tokens=step, prefill_every=every, overlap_rounds=overlap,
                              auto=auto)
    tok = Table(title=f"predicted tok/s (cost curve {curve.device}, {curve.model}"
                      f"{'' if curve.prefill_tokens else '; prefill not modelled'})")
    keys = [(c, n) for c in ctxs for n in concs]
    tok.add_column("setting")
    for c, n in keys:
        tok.add_column(f"ctx {c} C={n}", justify="right")
    by = {(p.config, p.context, p.concurrency): p for p in cells_out}
    for label in dict.fromkeys(p.config for p in cells_out):
        tok.add_row(label, *[f"{by[(label, c, n)].tok_s:.1f}" + ("*" if by[(label, c, n)].extrapolated else "")
                             + (f" ({by[(label, c, n)].accept_length:.2f})" if by[(label, c, n)].auto_budgets else "")
                             for c, n in keys])
    Console().print(tok)
    if auto is not None:
        typer.echo("budget auto: (its replayed accept length per cell); the sizes it chose are in the JSON "
                   "(auto_budgets: row-rounds per size)")
    doc = predicted_document(cells_out, curve=curve, curve_path=str(cost_curve), trace=loaded.metadata(),
                             prefill_chunk=chunk, step_tokens=step, prefill_every=every, overlap_rounds=overlap)
    if run is not None:
        atomic_write_json(run / PREDICTED_FILE, doc)
        typer.echo(f"{run / PREDICTED_FILE} (* = outside the curve's grid: extrapolated)")
    elif json_out is not None:
        atomic_write_json(json_out.with_name(json_out.stem + ".tok_s.json"), doc)


@replay_app.command("curve")
# The engine's flags (--target, --draft, --device, --max-batch, --max-len, --max-budget, ...) come from EngineConfig.
@engine_options(exclude=("cost_curve",))
def curve_cmd(
    out: Path = typer.Option(Path("cost_curve.json"), help="Cost curve file to write."),
    rows: str | None = typer.Option(None, help="Rows (requests per round) to time, e.g. 1,2,4 (default: the engine's grid)."),
    budgets: str | None = typer.Option(None, help="Budgets to time, e.g. 0,4,15,16,64 (0 = AR; default: the engine's grid)."),
    kv_lens: str | None = typer.Option(None, help="Root positions (context tokens) to time, e.g. 64,256,640."),
    prefill_tokens: str | None = typer.Option(None, help="Prefill step sizes to time, e.g. 64,256,512 (none: skip)."),
    repeats: int = typer.Option(3, help="Timed rounds per point (the median is kept), after one untimed round."),
    *,
    engine_config: EngineConfig,
) -> None:
    """Measure a cost curve (one round's wall seconds per rows x budget x kv_len) on the engine's real runner."""
    from dataclasses import replace

    from ddtree.engine import Engine
    from ddtree.engine.cost_curve import save_curve
    from ddtree.engine.cost_measure import (
        CostGrid,
        engine_device_name,
        engine_grid,
        measure_cost_curve,
        prefill_context_for,
    )
    from ddtree.lab.sweep.grid import parse_list

    def ints(text: str | None, what: str, default: tuple[int, ...]) -> tuple[int, ...]:
        if text is None:
            return default
        if text.strip().lower() == "none":
            return ()
        return tuple(int(v) for v in parse_list(text, what=what, optional=False) if v is not None)

    config = engine_config.validated()
    wanted_rows = ints(rows, "rows", ())
    if wanted_rows:
        config = replace(config, max_batch=max(config.max_batch, max(wanted_rows))).validated()
    engine = Engine.from_config(config)
    try:
        engine.parts.warmup.run()
        base = engine_grid(engine.parts)
        kv = ints(kv_lens, "kv_lens", base.kv_lens)
        prefill = ints(prefill_tokens, "prefill_tokens", base.prefill_tokens)
        # no tree's own points (budget auto's budget 0) and the prefill points after a context, as the engine's
        grid = CostGrid(rows=wanted_rows or base.rows, budgets=ints(budgets, "budgets", base.budgets), kv_lens=kv,
                        block_size=base.block_size, prefill_tokens=prefill, repeats=repeats, context=base.context,
                        prefill_context=prefill_context_for(kv, prefill, engine.runner.target_cache.max_len))
        typer.echo(f"timing {grid.points} points x {repeats + 1} rounds "
                   f"+ {len(grid.prefill_tokens)} prefill sizes ...")
        curve = measure_cost_curve(engine.runner, grid, graphs=engine.parts.graphs,
                                   prefill_graphs=engine.parts.prefill_graphs,
                                   device_name=engine_device_name(engine.device),
                                   model=f"{engine.model_name} ({engine.config.dtype})")
    finally:
        engine.shutdown(drain_timeout=0)
    save_curve(curve, out)
    typer.echo(f"{out}: {curve.device}, {curve.model}, measured in {curve.measure_seconds:.1f} s")


__all__ = ["read_prompts", "register"]
