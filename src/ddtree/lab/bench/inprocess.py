"""The in-process target of ``ddtree bench``: the benchmark drives an :class:`~ddtree.engine.Engine` directly.

No HTTP: a run hands its requests to :meth:`Engine.generate` with ``max_in_flight = concurrency``, the engine's
own closed loop (at most C submitted and unfinished; the next is submitted as one finishes, vLLM's and SGLang's
``--max-concurrency``). Every time comes from the engine's result: ``RequestStats.submitted_at`` (when ``submit``
accepted the request), ``ttft_s`` and ``latency_s`` (from then on). Nothing is patched or wrapped.

Definitions of one run (``run_cell``; ``benchmarks/gpu.py``'s cells and ``ddtree bench --in-process`` both)
-----------------------------------------------------------------------------------------------------------
wall
    From just before the first request is handed over (the device idle: CUDA synchronized) to
    :meth:`Engine.generate` returning, i.e. the last request's final chunk read by the caller.
tok/s
    Completion tokens of every request / wall (prefill included; C in flight).
timeline
    Per request ``[submitted, first token, finished]``, seconds from the run's start: ``submitted_at - t0``,
    ``+ ttft_s``, ``+ latency_s``.
decode tok/s
    Tokens after the first over the time after the first, summed over requests (a request's decoding speed
    without its prefill); per request: ``(n - 1) / (latency - ttft)``, averaged.
acceptance length
    Completion tokens / verify rounds, summed over requests (SGLang's count, the bonus token included).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.api import GenerationOutput, GenerationRequest, SamplingParams, TreeSettings
from ddtree.errors import ConfigError


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a CPU runs synchronously."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class EngineRun:
    """One closed-loop run: the outputs in request order, ``t0`` (perf_counter at the start) and the wall time."""

    outputs: list[GenerationOutput]
    t0: float
    wall_s: float

    def timeline(self) -> list[list[float]]:
        """``[submitted, first token, finished]`` per request, seconds from ``t0`` (engine-recorded times)."""
        rows = []
        for o in self.outputs:
            s = o.stats
            if s.submitted_at is None:
                raise ConfigError(f"request {o.request_id} has no submission time; was it run by this engine?")
            sub = s.submitted_at - self.t0
            rows.append([round(sub, 4), round(sub + (s.ttft_s or 0.0), 4), round(sub + (s.latency_s or 0.0), 4)])
        return rows


def bench_requests(prompts: Sequence[Sequence[int]], tree: TreeSettings, new_tokens: int | Sequence[int],
                   temperatures: Sequence[float] | None = None) -> list[GenerationRequest]:
    """Token-id prompts, exactly ``new_tokens`` each (``ignore_eos``): one count for all, or one per prompt. Greedy,
    unless ``temperatures`` gives one per prompt (0: greedy); a sampled request's seed is its index, so every config
    and repeat of a run samples from the same streams."""
    counts = list(new_tokens) if not isinstance(new_tokens, int) else [new_tokens] * len(prompts)
    temps = [0.0] * len(prompts) if temperatures is None else list(temperatures)
    return [GenerationRequest(prompt_token_ids=list(p), tree=tree,
                              sampling=SamplingParams(max_tokens=n, ignore_eos=True, temperature=t,
                                                      seed=i if t > 0 else None))
            for i, (p, n, t) in enumerate(zip(prompts, counts, temps, strict=True))]


def run_closed_loop(engine: Any, requests: Sequence[GenerationRequest], concurrency: int | None) -> EngineRun:
    """Run ``requests`` through ``engine`` with at most ``concurrency`` in flight (None: all at once)."""
    synchronize(engine.device)
    t0 = time.perf_counter()
    outputs = engine.generate(list(requests), max_in_flight=concurrency)
    return EngineRun(outputs=outputs, t0=t0, wall_s=time.perf_counter() - t0)


def mean_in_flight(timeline: list[list[float]], wall: float) -> float:
    """Requests in flight averaged over the run's wall time, from the (submitted, first token, finished) timeline.
    Below C it says how much of the run the closed loop spent filling up or draining: a method whose requests take
    different times (speculative decoding: acceptance varies with the text) drains for longer than AR, whose
    fixed-length requests all finish together."""
    events = sorted([(s, 1) for s, _, _ in timeline] + [(f, -1) for _, _, f in timeline])
    area, in_flight, last = 0.0, 0, 0.0
    for t, step in events:
        area += in_flight * (t - last)
        in_flight, last = in_flight + step, t
    return area / max(wall, 1e-9)


def run_cell(engine: Any, prompts: Sequence[Sequence[int]], tree: TreeSettings, new_tokens: int | list[int], *,
             concurrency: int | None = None, temperatures: Sequence[float] | None = None) -> dict:
    """Every prompt through ``engine``, at most ``concurrency`` in flight; the run's measurements (module doc).

    With more prompts than the concurrency, acceptance averages over texts and the throughput is the loop's, not
    one batch's drain to its slowest request. ``new_tokens``: one count for every prompt, or one per prompt;
    ``temperatures``: greedy when None, else one per prompt (:func:`bench_requests`)."""
    run = run_closed_loop(engine, bench_requests(prompts, tree, new_tokens, temperatures), concurrency)
    outs, wall = run.outputs, run.wall_s
    errors = [o.error for o in outs if o.finish_reason == "error"]
    completion = sum(len(o.token_ids) for o in outs)
    rounds = sum(o.stats.verify_rounds for o in outs)
    stage: dict[str, float] = {}
    for o in outs:
        for k, v in o.stats.stage_s.items():
            stage[k] = stage.get(k, 0.0) + v
    per_round = {k: 1e3 * v / max(rounds, 1) for k, v in stage.items() if k != "prefill"}
    decode = [(len(o.token_ids) - 1) / max(o.stats.latency_s - o.stats.ttft_s, 1e-9) for o in outs]
    decode_tok_s = sum(len(o.token_ids) - 1 for o in outs) / max(
        sum(o.stats.latency_s - o.stats.ttft_s for o in outs), 1e-9)
    # Wall time of a decode round as a request sees it; minus the stages' device time it is the host's share.
    round_ms = statistics.mean(1e3 * (o.stats.latency_s - o.stats.ttft_s) / max(o.stats.verify_rounds, 1) for o in outs)
    return {
        "tok_s": completion / wall,
        "decode_tok_s_per_request": statistics.mean(decode),
        "decode_tok_s": decode_tok_s,
        "accept_length": completion / max(rounds, 1),
        "wall_s": wall,
        "ttft_s_mean": statistics.mean(o.stats.ttft_s or 0.0 for o in outs),
        "stage_ms_per_round": per_round,
        "round_ms": round_ms,
        "errors": errors,
        "tokens": [o.token_ids for o in outs],
        "timeline": run.timeline(),
        # budget "auto": rounds per chosen budget over the cell's requests ({} for a fixed budget)
        "auto_budgets": _summed(o.stats.auto_budgets for o in outs),
    }


def _summed(counts: Iterable[dict[int, int]]) -> dict[int, int]:
    return dict(sorted(sum((Counter(c) for c in counts), Counter()).items()))


# ---- ddtree bench --in-process: the cell files of the HTTP target, measured by the engine ----------------------
def tree_from_extra_body(extra_body: dict) -> TreeSettings | None:
    """``--extra-body``'s ``{"ddtree": {...}}`` as the requests' tree settings (the server reads the same object);
    any other key has no meaning without HTTP and is refused by name."""
    unknown = sorted(set(extra_body) - {"ddtree"})
    if unknown:
        raise ConfigError(f"--extra-body {unknown} mean nothing in process; only {{\"ddtree\": {{...}}}} applies")
    settings = extra_body.get("ddtree")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise ConfigError(f"--extra-body's \"ddtree\" must be an object of tree settings, got {settings!r}")
    return TreeSettings().merged(settings)


def request_record(output: GenerationOutput) -> dict[str, Any]:
    """One request as ``ddtree.bench.cell/1`` records it, from the engine's stats (no chunk times: ``itl_s`` is
    empty, ``itl_source`` "none"; TPOT and decode tok/s come from ``ttft_s`` and ``latency_s``)."""
    s = output.stats
    return {
        "prompt_tokens": len(output.prompt_token_ids), "prompt_tokens_sent": len(output.prompt_token_ids),
        "completion_tokens": len(output.token_ids), "ttft_s": s.ttft_s, "latency_s": s.latency_s,
        "itl_s": [], "itl_source": "none", "chunks": 0, "spec_verify_ct": s.verify_rounds,
        "accept_length": s.accept_length, "accept_hist": list(s.accept_hist), "correct_drafts": None,
        "proposed_drafts": None, "spec_source": "engine", "finish_reason": output.finish_reason,
        "error": output.error if output.finish_reason == "error" else None,
        "submitted_s": None,  # filled in by run_engine_cell (seconds from the run's start)
    }


def run_engine_cell(engine: Any, workload: Any, context: int, concurrency: int, tokenizer: Any,
                    tokenizer_name: str, config: dict, tree: TreeSettings | None,
                    advance: Callable[[], None] = lambda: None) -> dict:
    """One ``ddtree.bench.cell/1`` cell measured in process (the HTTP target's warm-up, prompts and summary)."""
    from ddtree.lab.bench.metrics import summarize_cell, summarize_run
    from ddtree.lab.bench.run import CELL_SCHEMA
    from ddtree.lab.bench.workload import build_prompts

    n = workload.requests_for(concurrency)
    key = {"seed": workload.seed, "context": context, "concurrency": concurrency, "text": workload.text}

    def requests(prompts) -> list[GenerationRequest]:
        return [GenerationRequest(prompt_token_ids=list(p.ids), tree=tree,
                                  sampling=SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True))
                for p in prompts]

    if workload.warmup:
        run_closed_loop(engine, requests(build_prompts(tokenizer, context, n, phase="w", **key)), concurrency)
    runs, lengths = [], []
    for repeat in range(workload.repeats):
        prompts = build_prompts(tokenizer, context, n, phase=f"r{repeat}-", **key)
        lengths.extend(len(p.ids) for p in prompts)
        run = run_closed_loop(engine, requests(prompts), concurrency)
        records = []
        for out, (submitted, _, _) in zip(run.outputs, run.timeline(), strict=True):
            records.append({**request_record(out), "submitted_s": submitted})
            advance()
        runs.append({"requests": records, "summary": summarize_run(records, run.wall_s)})
    return {
        "schema": CELL_SCHEMA, "config": config, "engine": "ddtree",
        "workload": {"context": context, "concurrency": concurrency, "output_tokens": workload.output_tokens,
                     "text": workload.text, "num_requests": n, "repeats": workload.repeats, "seed": workload.seed,
                     "endpoint": "engine", "warmup": workload.warmup, "tokenizer": tokenizer_name,
                     "prompt_lengths": lengths},
        "runs": runs,
        "summary": summarize_cell([r["summary"] for r in runs]),
        "env": {"time": datetime.now(timezone.utc).isoformat(timespec="seconds")},
    }


def run_engine_bench(engine: Any, workload: Any, *, out_dir: Path | None, config: dict,
                     tree: TreeSettings | None = None, progress: bool = True) -> list[dict]:
    """:func:`ddtree.lab.bench.run_bench` against a started ``engine`` in this process: every cell of
    ``workload``, one JSON file per cell in ``out_dir`` (when given), the cells returned. ``tree``: the requests'
    settings (None: the engine's defaults)."""
    import platform
    import sys

    from ddtree import __version__
    from ddtree.files import atomic_write_json
    from ddtree.lab.bench.run import _Progress, cell_filename

    workload = workload.validated()
    tokenizer, tokenizer_name = engine.tokenizer, engine.model_name
    env = {"ddtree_version": __version__, "url": None, "model": engine.model_name, "python": sys.version.split()[0],
           "platform": platform.platform(), "server_info": engine.info()}
    cells = []
    total = sum(workload.requests_for(c) * workload.repeats for _, c in workload.cells())
    with _Progress(progress, total) as bar:
        for context, concurrency in workload.cells():
            bar.describe(f"ctx {context} x c{concurrency}")
            cell = run_engine_cell(engine, workload, context, concurrency, tokenizer, tokenizer_name, config, tree,
                                   bar.advance)
            cell["env"] = {**env, **cell["env"]}
            cells.append(cell)
            if out_dir is not None:
                atomic_write_json(Path(out_dir) / cell_filename(context, concurrency), cell)
    return cells
