"""Budget auto's chooser constants A/B'd on one engine: fixed budgets and auto variants, alternating, per cell.

Why one process: between device calls the same cell's tok/s moved by up to 8 % (docs/benchmarks.md, "Arrivals at 64
in flight": auto with the same code read 11085-11971 tok/s in four calls), as much as the differences auto's bar
asks about. Here one engine (the Qwen3-8B stand-in, bf16, CUDA graphs, greedy, the engine's defaults, the cost curve
measured at start, or by auto's first round with ``--cost-curve off``) runs every config of a cell in turn,
``--repeats`` times, so a drift of the machine falls on all of them; a config's tok/s is its median.

A variant sets module constants of :mod:`ddtree.engine.auto_budget` (read by the chooser at every round) before its
runs: ``--variants "new:EXPLORE_SLACK=0.10 old:EXPLORE_SLACK=0.25"``. Each auto run also counts its exploring
rounds (a launch whose size differs from the best, :meth:`AutoChooser.choose`).

``--settings "steps:prefill_step_tokens=2048 mixed:mixed_chunk=2048"`` runs every config under each named set of
engine settings (``EngineConfig`` fields the scheduler reads at every round or step: ``prefill_step_tokens``,
``mixed_chunk``, ``prefill_every``), set on the running engine between runs; the engine is built with the largest
value of each field (the warm-up plan follows ``prefill_step_tokens``), and every field a setting leaves out keeps
the built value, except ``mixed_chunk``, which is 0 unless a setting names it. A config's name then
ends in ``@name``, and "/ best fixed" compares within one setting. ``--step-tokens 512,2048`` is short for
``--settings "512:prefill_step_tokens=512 2048:prefill_step_tokens=2048"``.

``--old-grid`` runs every auto variant twice: as measured (the engine's grid), and as ``auto-<name>~oldgrid``
dividing by the same measurements restricted to the grid engine start measured before 2026-12-07 (rows 1/4/16 and
``max_batch``, budgets 0/3/15 and ``max_budget``) and read as that code read it (a drafting budget interpolated
toward AR's point: :class:`OldGridCurve`), so the grid's effect is timed on one engine.

A cell is ``C:context``; it runs ``--waves`` x C prompts, C in flight (newcomers arrive as requests finish); with
``--mix-words`` every other one is random words instead of held-out code, meant to make rows that differ in
confidence (on the demo pair they accept as much as code: docs/benchmarks.md, "Budget auto's predictions"); with
``--mix-sampled T`` every other request (``--sampled-share``: another share, 1 = all) samples at temperature ``T``
(seeded by its index), which does ("=AR" counts the sampled rows too; the sampling is counter-based, and in fp32
on the CPU every sampled row equalled AR's). Every config is warmed up once per cell (``--warm-waves``, 2: arrivals while others decode), then timed. Writes
``OUT/auto_ab.json`` after every run (and ``OUT/cost_curve.json``, the curve auto divided by); prints a table.

    python benchmarks/auto_ab.py --out $OUT --cells 64:60,64:1024 --budgets 7 --repeats 3 \\
        --variants "new:EXPLORE_SLACK=0.10 old:EXPLORE_SLACK=0.25"
    python benchmarks/auto_ab.py --out $OUT --cells 64:1024 --budgets 7 --repeats 2 --variants "new:" \\
        --settings "off: mixed:mixed_chunk=2048"
    python benchmarks/auto_ab.py --out /tmp/x --shape none --device cpu --cells 4:64 --budgets 4 --repeats 1 \\
        --waves 1 --new-tokens 16 --variants "a:EXPLORE_SLACK=0.10"    # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path

import torch
from auto_trace import AutoTrace  # benchmarks/, this script's directory
from auto_trace import summary as trace_summary

from ddtree.engine import Engine, EngineConfig, TreeSettings, auto_budget, prefill_steps
from ddtree.engine.cost_curve import CostCurve, save_curve
from ddtree.lab.bench.inprocess import run_cell, synchronize
from ddtree.lab.bench.workload import build_prompts, held_out_token_stream, prompts_for


def parse_variants(text: str) -> dict[str, dict[str, float]]:
    """``"name:CONST=value,CONST=value name2:..."`` -> {name: {CONST: value}}; unknown constants fail here."""
    out: dict[str, dict[str, float]] = {}
    for part in text.split():
        name, _, body = part.partition(":")
        consts = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if not hasattr(auto_budget, key):
                raise SystemExit(f"--variants: ddtree.engine.auto_budget has no constant {key!r}")
            consts[key] = float(value)
        out[name] = consts
    return out


def sampled_temperatures(count: int, temperature: float, share: float) -> list[float]:
    """Each request's temperature: ``temperature`` for a ``share`` of them spread evenly (request ``i`` is sampled
    when ``floor((i + 1) share)`` passes ``floor(i share)``: 0.5 samples requests 1, 3, 5, ..., 1 every one), 0 for
    the rest."""
    return [temperature if int((i + 1) * share) > int(i * share) else 0.0 for i in range(count)]


SETTABLE = ("prefill_step_tokens", "mixed_chunk", "prefill_every")  # read by the scheduler at every round or step


def parse_settings(text: str, step_tokens: str) -> list[tuple[str | None, dict[str, int]]]:
    """``"name:FIELD=value,... name2:..."`` (or ``--step-tokens`` "512,2048") -> [(name, {field: value})];
    [(None, {})] when neither is given (the engine as built). Fields outside :data:`SETTABLE` fail here."""
    if text and step_tokens:
        raise SystemExit("--settings and --step-tokens: give one")
    if step_tokens:
        return [(x, {"prefill_step_tokens": int(x)}) for x in step_tokens.split(",") if x]
    out: list[tuple[str | None, dict[str, int]]] = []
    for part in text.split():
        name, _, body = part.partition(":")
        fields = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in SETTABLE:
                raise SystemExit(f"--settings: {key!r} is not one of {', '.join(SETTABLE)}")
            fields[key] = int(value)
        out.append((name, fields))
    return out or [(None, {})]


class ExploreCounter:
    """Counts the exploring choices (size != best) of :meth:`AutoChooser.choose` while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._real = auto_budget.AutoChooser.choose

    def __enter__(self) -> ExploreCounter:
        real = self._real

        def counted(chooser, *args, **kwargs):
            size, best = real(chooser, *args, **kwargs)
            self.count += size != best
            return size, best

        auto_budget.AutoChooser.choose = counted
        return self

    def __exit__(self, *exc) -> None:
        auto_budget.AutoChooser.choose = self._real


class OldGridCurve(CostCurve):
    """A curve read as ``CostCurve.round_seconds`` read it before 2026-12-07: trilinear over the whole budget axis,
    so a b1 round is a third of the way from AR's point to b3's (the A/B of ``--old-grid``)."""

    def round_seconds(self, rows: int, budget: int, kv_len: int, *, keeps_context: bool = False) -> float:
        return self.interpolated(rows, budget, kv_len)  # the old grid had no context points


def old_grid(curve: CostCurve, max_batch: int, max_budget: int) -> OldGridCurve:
    """``curve`` on the grid engine start measured before 2026-12-07 (rows 1, 4, 16 below ``max_batch`` and
    ``max_batch``; budgets 0, 3, 15 below ``max_budget`` and ``max_budget``), every point its own measurement."""
    rows = sorted({1, max_batch} | {r for r in (4, 16) if r < max_batch})
    budgets = sorted({0, max_budget} | {b for b in (3, 15) if b < max_budget})
    sub = curve.restricted(rows=rows, budgets=budgets)
    return OldGridCurve(**{f.name: getattr(sub, f.name) for f in dataclass_fields(CostCurve)})


def warm_up(engine: Engine, prompts: list, tree: TreeSettings, new_tokens: int, conc: int) -> None:
    """An untimed run of ``prompts``, ``conc`` in flight, with mixed graph captures unbudgeted
    (``prefill_steps.MIXED_CAPTURE_SHARE``): with two waves or more, newcomers arrive while others decode, so a mixed
    setting captures its graphs here, as a server that has run a while has them, instead of in the first timed
    repeat (2026-12-07: 4-10 captures of 0.27 s there, and riders deferred)."""
    share = prefill_steps.MIXED_CAPTURE_SHARE
    prefill_steps.MIXED_CAPTURE_SHARE = float("inf")
    try:
        run_cell(engine, prompts, tree, new_tokens, concurrency=conc)
    finally:
        prefill_steps.MIXED_CAPTURE_SHARE = share


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", help="stand-in shape, or 'none' for the demo pair as is")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cells", default="64:60,64:1024", help="C:context,...")
    ap.add_argument("--budgets", default="7", help="fixed budgets run beside auto in every cell")
    ap.add_argument("--no-ar", action="store_true", help="leave AR out (it runs once a cell, first)")
    ap.add_argument("--variants", default="default:", help="auto variants: 'name:CONST=value,... name2:...'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--warm-waves", type=int, default=2,
                    help="waves of the untimed warm-up run of each config (2: arrivals while others decode)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="EngineConfig.prefill_chunk (the cache keeps this much headroom per slot: 1024 lets C = 64 at "
                         "8k fit one H200)")
    ap.add_argument("--step-tokens", default="",
                    help="prefill step sizes to run every config at, e.g. 512,2048 (default: the engine's own)")
    ap.add_argument("--settings", default="",
                    help="named engine settings to run every config under: 'name:FIELD=value,... name2:...' "
                         f"(fields: {', '.join(SETTABLE)})")
    ap.add_argument("--cost-curve", default="auto",
                    help="EngineConfig.cost_curve: auto (measured at engine start, on the engine's grid), off (budget "
                         "auto measures its own fallback curve at its first round, as `ddtree sweep` runs it), a path")
    ap.add_argument("--old-grid", action="store_true",
                    help="also run each auto variant on the same curve restricted to the pre-2026-12-07 grid")
    ap.add_argument("--trace", action="store_true",
                    help="trace every auto run's predictions against its rounds (auto_trace.py): a summary per size in "
                         "the run's row, the rounds in OUT/trace-<C>-<context>-<config>-<repeat>.json")
    ap.add_argument("--mix-words", action="store_true",
                    help="every other prompt random words instead of held-out code")
    ap.add_argument("--mix-sampled", type=float, default=0.0,
                    help="every other request sampled at this temperature (seeded), the rest greedy")
    ap.add_argument("--sampled-share", type=float, default=0.5,
                    help="with --mix-sampled: the share of requests sampled, spread evenly (0.5: every other, 1: all)")
    ap.add_argument("--time-budget", type=float, default=500.0, help="seconds from start after which no run starts")
    args = ap.parse_args(argv)
    if args.mix_sampled < 0:
        raise SystemExit(f"--mix-sampled: a temperature >= 0, got {args.mix_sampled}")
    if not 0 < args.sampled_share <= 1:
        raise SystemExit(f"--sampled-share: a share in (0, 1], got {args.sampled_share}")
    cells = [tuple(int(x) for x in c.split(":")) for c in args.cells.split(",") if c]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    variants = parse_variants(args.variants)
    settings = parse_settings(args.settings, args.step_tokens)
    largest = {f: max(fields[f] for _, fields in settings if f in fields)
               for f in SETTABLE if any(f in fields for _, fields in settings)}
    defaults = {k: getattr(auto_budget, k) for v in variants.values() for k in v}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "auto_ab.json"
    t0 = time.perf_counter()
    device = torch.device(args.device)

    from ddtree.models.standin import load_benchmark_models

    target, drafter, tokenizer, dtype = load_benchmark_models(args.shape, device)
    config = EngineConfig(max_batch=max(c for c, _ in cells), max_len=max(x for _, x in cells) + args.new_tokens + 16,
                          max_budget=max(*budgets, 32), max_queue=4096, warmup="none", cost_curve=args.cost_curve,
                          **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}),
                          **largest)
    engine = Engine(target, drafter, tokenizer, config, model_name=f"standin-{args.shape}")
    engine.start()
    synchronize(device)
    if engine.cost_curve is not None:  # what auto divided by (the H100's was lost on 2026-12-07): replay reads it
        save_curve(engine.cost_curve, out_dir / "cost_curve.json")
    stream = held_out_token_stream(tokenizer, max(x for _, x in cells) * 2 + 4096)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype),
              "shape": args.shape, "mix_words": args.mix_words, "mix_sampled": args.mix_sampled,
              "sampled_share": args.sampled_share if args.mix_sampled > 0 else None,
              "new_tokens": args.new_tokens, "waves": args.waves, "variants": variants,
              "defaults": defaults, "engine_start_s": time.perf_counter() - t0,
              "prefill_every": engine.config.prefill_every, "prefill_chunk": engine.config.prefill_chunk,
              "prefill_step_tokens": engine.config.prefill_step_tokens, "mixed_chunk": engine.config.mixed_chunk,
              "settings": {name: fields for name, fields in settings if name is not None},
              "runs": [], "skipped": []}
    built = engine.config
    base = ([] if args.no_ar else [("ar", TreeSettings(method="ar"), {})]) + [
        (f"b{b}", TreeSettings(method="ddtree", budget=b), {}) for b in budgets] + [
        (f"auto-{name}{twin}", TreeSettings(method="ddtree", budget="auto"), consts)
        for name, consts in variants.items() for twin in ("", "~oldgrid")[: 1 + args.old_grid]]
    curves = {"": engine.cost_curve}
    if args.old_grid:
        if engine.cost_curve is None:
            raise SystemExit("--old-grid needs the curve measured at engine start (--cost-curve auto)")
        curves["~oldgrid"] = old_grid(engine.cost_curve, config.max_batch, config.max_budget)
    configs = [(name if setting is None else f"{name}@{setting}", tree, consts, fields)
               for setting, fields in settings for name, tree, consts in base]
    for conc, ctx in cells:
        prompts = prompts_for(stream, ctx, conc * args.waves, salt=ctx)
        if args.mix_words:
            words = build_prompts(tokenizer, ctx, len(prompts) // 2, phase="mix", seed=0, context=ctx,
                                  concurrency=conc, text="words")
            prompts[1::2] = [p.ids for p in words]
        temps = sampled_temperatures(len(prompts), args.mix_sampled, args.sampled_share) if args.mix_sampled > 0 else None
        refs: list | None = None
        for rep in range(args.repeats):
            for name, tree, consts, fields in configs:
                if name.split("@")[0] == "ar" and rep > 0:
                    continue
                key = {"concurrency": conc, "context": ctx, "config": name, "repeat": rep}
                if time.perf_counter() > t0 + args.time_budget:
                    report["skipped"].append(key)
                    continue
                for k, v in {**defaults, **consts}.items():
                    setattr(auto_budget, k, v)
                engine.config = replace(built, **{"mixed_chunk": 0, **fields})
                if args.old_grid:
                    engine.cost_curve = curves["~oldgrid" if name.split("@")[0].endswith("~oldgrid") else ""]
                if rep == 0:  # graphs captured and kernels compiled outside the timed run
                    warm_up(engine, prompts[: conc * args.warm_waves], tree, args.new_tokens, conc)
                mixed_before = engine._counters.mixed_rounds_total, engine._counters.mixed_deferred_total
                captures_before = 0 if engine.graphs is None else engine.graphs.mixed_captures
                traced = args.trace and tree.auto
                with ExploreCounter() as explored, AutoTrace(engine) if traced else nullcontext() as trace:
                    res = run_cell(engine, prompts, tree, args.new_tokens, concurrency=conc, temperatures=temps)
                if name.split("@")[0] == "ar":
                    refs = res["tokens"]
                row = {**key, "tok_s": res["tok_s"], "accept_length": res["accept_length"],
                       "round_ms": res["round_ms"], "ttft_s_mean": res["ttft_s_mean"],
                       "stage_ms_per_round": {k: round(v, 3) for k, v in res["stage_ms_per_round"].items()},
                       "auto_budgets": {str(b): n for b, n in sorted(res["auto_budgets"].items())},
                       "explored_rounds": explored.count,
                       "mixed_rounds": engine._counters.mixed_rounds_total - mixed_before[0],
                       "mixed_deferred": engine._counters.mixed_deferred_total - mixed_before[1],
                       "mixed_captures": (0 if engine.graphs is None else engine.graphs.mixed_captures) - captures_before,
                       "errors": res["errors"][:3],
                       "identical_to_ar": None if refs is None else sum(a == b for a, b in zip(res["tokens"], refs,
                                                                                                strict=True))}
                if traced:
                    row["trace"] = trace_summary(trace.records)
                    (out_dir / f"trace-{conc}-{ctx}-{name}-{rep}.json").write_text(json.dumps(trace.records))
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
                out.write_text(json.dumps(report, indent=1))
    for k, v in defaults.items():
        setattr(auto_budget, k, v)
    engine.shutdown(drain_timeout=0)
    report["total_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=1))
    print(table(report))


def table(report: dict) -> str:
    """Per cell and config: the median tok/s over the repeats (each repeat's), acceptance, round ms, explored
    rounds, mixed rounds and rounds whose riders were deferred (the capture budget), and the ratio to the cell's best
    fixed budget. "stages ms": a round's device stages (draft, tree, verify, commit) summed, so "round ms" past it is
    what the loop spends beside them (host work, prefill steps)."""
    lines = ["| C | ctx | config | tok/s median (each) | / best fixed | accept | round ms | stages ms | TTFT s | explored "
             "| mixed / deferred | =AR |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    cells = list(dict.fromkeys((r["concurrency"], r["context"]) for r in report["runs"]))
    for cell in cells:
        runs = [r for r in report["runs"] if (r["concurrency"], r["context"]) == cell]
        names = list(dict.fromkeys(r["config"] for r in runs))
        med = {n: statistics.median(r["tok_s"] for r in runs if r["config"] == n) for n in names}
        for n in names:
            fixed = [f for f in names if f.startswith("b") and f.partition("@")[2] == n.partition("@")[2]]
            best = max((med[f] for f in fixed), default=None)
            mine = [r for r in runs if r["config"] == n]
            each = ", ".join(f"{r['tok_s']:.0f}" for r in mine)
            ratio = f"{med[n] / best:.3f}x" if best else "-"
            lines.append(f"| {cell[0]} | {cell[1]} | {n} | {med[n]:.0f} ({each}) | {ratio} | "
                         f"{statistics.mean(r['accept_length'] for r in mine):.3f} | "
                         f"{statistics.mean(r['round_ms'] for r in mine):.2f} | "
                         f"{statistics.mean(sum(r['stage_ms_per_round'].values()) for r in mine):.2f} | "
                         f"{statistics.mean(r['ttft_s_mean'] for r in mine):.3f} | "
                         f"{sum(r['explored_rounds'] for r in mine)} | "
                         f"{sum(r.get('mixed_rounds', 0) for r in mine)} / {sum(r.get('mixed_deferred', 0) for r in mine)} | "
                         f"{mine[0]['identical_to_ar']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
