"""``run_bench``: the context x concurrency matrix against one server, one JSON file per cell.

Per cell: a warm-up run shaped like the measured ones (as many requests, the same output length, the same
concurrency, its own prompts), then ``repeats`` runs. Why the full shape: a GPU engine captures graphs and compiles
kernels on first use of a shape, and shapes depend on how far requests have got (our engine's graphs are keyed by
cache-length buckets, which a request crosses late) and on how they arrive; a warm-up of a few short requests left
those costs inside measured runs (on the H200, 1.7-2.6 s of Triton compilation in a 3-10 s run: runs 37-38 in
``docs/benchmarks.md``). A run keeps ``concurrency``
requests in flight until ``num_requests`` have finished (closed loop), every request streamed with a fixed
output length (``ignore_eos``, greedy) and a prompt of exactly ``context`` tokens with a unique prefix.
Acceptance counters are read after the warm-up and after each run, so their difference covers that run alone;
on SGLang ``/flush_cache`` is called before each run so ``/server_info``'s cumulative average covers it alone too.

Cell file ``ctx{context}-c{concurrency}.json`` (schema ``ddtree.bench.cell/1``)::

    {"schema", "config": {...as given...}, "engine": "ddtree|sglang|vllm|openai",
     "workload": {"context", "concurrency", "output_tokens", "num_requests", "repeats", "seed", "text", "endpoint",
                  "warmup", "tokenizer", "prompt_lengths": [exact token counts sent, one per measured request]},
     "runs": [{"requests": [{"prompt_tokens", "prompt_tokens_sent", "completion_tokens", "ttft_s", "latency_s",
                             "itl_s": [per token], "itl_source", "chunks", "spec_verify_ct", "accept_length",
                             "accept_hist", "correct_drafts", "proposed_drafts", "spec_source",
                             "finish_reason", "error"}, ...],
               "summary": {see ddtree.lab.bench.metrics.RUN_SUMMARY_KEYS}}],
     "summary": {the run summaries averaged, "output_tok_s_spread": {"min", "max", "std", "n"}},
     "env": {"ddtree_version", "time", "url", "model", "python", "platform", "server_info": {...}}}

Files are written atomically (a temporary file, then ``os.replace``), so a killed benchmark never leaves a
half-written cell behind.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddtree import __version__
from ddtree.files import atomic_write_json
from ddtree.lab.bench.metrics import request_record, summarize_cell, summarize_run
from ddtree.lab.bench.workload import Prompt, Workload, build_prompts, load_tokenizer
from ddtree.lab.client import BenchTarget, Completion, OpenAIClient
from ddtree.lab.engines import REQUEST_EXTRAS, CounterAcceptance

CELL_SCHEMA = "ddtree.bench.cell/1"


def cell_filename(context: int, concurrency: int) -> str:
    return f"ctx{context}-c{concurrency}.json"


async def run_bench(target: BenchTarget, workload: Workload, *, out_dir: Path | None, config: dict,
                    progress: bool = True, tokenizer: Any = None) -> list[dict]:
    """Benchmark every cell of ``workload`` against ``target``; returns the cell dicts (also written to
    ``out_dir`` when given). ``config`` is recorded as is (e.g. the tree settings under test). ``tokenizer``:
    an already-loaded tokenizer, else ``target.tokenizer``, else the demo target's."""
    target = target.validated()
    workload = workload.validated()
    if tokenizer is None:
        tokenizer, tokenizer_name = load_tokenizer(target.tokenizer)
    else:
        tokenizer_name = target.tokenizer or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    cells: list[dict] = []
    async with OpenAIClient(target) as client:
        engine = target.engine if target.engine != "auto" else await client.detect_engine()
        model = await client.model()
        info = await client.server_info(engine)
        env = {"ddtree_version": __version__, "url": target.url, "model": model,
               "python": sys.version.split()[0], "platform": platform.platform(), "server_info": info}
        total = sum(workload.requests_for(c) * workload.repeats for _, c in workload.cells())
        with _Progress(progress, total) as bar:
            for context, concurrency in workload.cells():
                bar.describe(f"ctx {context} x c{concurrency}")
                cell = await _run_cell(client, engine, workload, context, concurrency, tokenizer, tokenizer_name,
                                       config, env, bar.advance)
                cells.append(cell)
                if out_dir is not None:
                    atomic_write_json(Path(out_dir) / cell_filename(context, concurrency), cell)
    return cells


async def _run_cell(client: OpenAIClient, engine: str, workload: Workload, context: int, concurrency: int,
                    tokenizer: Any, tokenizer_name: str, config: dict, env: dict,
                    advance: Callable[[], None]) -> dict:
    n = workload.requests_for(concurrency)
    key = {"seed": workload.seed, "context": context, "concurrency": concurrency, "text": workload.text}
    if workload.warmup:
        warm = build_prompts(tokenizer, context, n, phase="w", **key)
        await run_requests(client, engine, warm, concurrency, workload.output_tokens)
    counters = CounterAcceptance(engine)
    runs = []
    lengths: list[int] = []
    for repeat in range(workload.repeats):
        prompts = build_prompts(tokenizer, context, n, phase=f"r{repeat}-", **key)
        lengths.extend(len(p.ids) for p in prompts)
        before = await client.scrape()
        flushed = engine == "sglang" and await client.flush_cache()  # /server_info's average then covers this run
        start = time.perf_counter()
        completions = await run_requests(client, engine, prompts, concurrency, workload.output_tokens,
                                         on_done=advance)
        duration = time.perf_counter() - start
        after = await client.scrape()
        counter_accept, counter_depth = None, None
        if before is not None and after is not None:
            counter_accept = counters.from_counters(before, after)
            counter_depth = counters.depth_from_counters(before, after)
        info_accept = await client.server_info_accept_length() if flushed else None
        records = [request_record(c, len(p.ids), tokenizer) for c, p in zip(completions, prompts, strict=True)]
        runs.append({"requests": records,
                     "summary": summarize_run(records, duration, counter_accept_length=counter_accept,
                                              counter_depth=counter_depth,
                                              server_info_accept_length=info_accept)})
    return {
        "schema": CELL_SCHEMA,
        "config": config,
        "engine": engine,
        "workload": {"context": context, "concurrency": concurrency, "output_tokens": workload.output_tokens,
                     "text": workload.text,
                     "num_requests": n, "repeats": workload.repeats, "seed": workload.seed,
                     "endpoint": client.target.endpoint, "warmup": workload.warmup, "tokenizer": tokenizer_name,
                     "prompt_lengths": lengths},
        "runs": runs,
        "summary": summarize_cell([r["summary"] for r in runs]),
        "env": {**env, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")},
    }


async def run_requests(client: OpenAIClient, engine: str, prompts: Sequence[Prompt], concurrency: int,
                       output_tokens: int, *, on_done: Callable[[], None] | None = None) -> list[Completion]:
    """Send every prompt with at most ``concurrency`` in flight; results in prompt order."""
    results: list[Completion | None] = [None] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            prompt = prompts[i]
            sent = prompt.text if client.target.endpoint == "chat" else prompt.ids
            body = await client.body(prompt=sent, max_tokens=output_tokens, stream=True, ignore_eos=True,
                                     temperature=0.0, extra=REQUEST_EXTRAS.get(engine))
            results[i] = await client.complete(body)
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return [r for r in results if r is not None]


class _Progress:
    """A rich progress bar over all measured requests (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self._progress = None
        self._task = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task("bench", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def summary_table(cells: Sequence[dict]):
    """A rich table of the cells' summaries (one row per cell)."""
    from rich.table import Table

    def fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    table = Table(title="ddtree bench")
    for column in ("context", "conc", "out tok/s", "±std", "decode tok/s p50", "TTFT p50 ms", "TPOT ms",
                   "ITL p50 ms", "ITL p90 ms", "e2e p50 s", "accept", "errors"):
        table.add_column(column, justify="right")
    for cell in cells:
        s, w = cell["summary"], cell["workload"]
        table.add_row(
            str(w["context"]), str(w["concurrency"]), fmt(s["output_tok_s"]),
            fmt(s["output_tok_s_spread"]["std"]), fmt(s["decode_tok_s_p50"]), fmt(s["ttft_s_p50"], 1000),
            fmt(s["tpot_s_mean"], 1000, 2), fmt(s["itl_s_p50"], 1000, 2), fmt(s["itl_s_p90"], 1000, 2),
            fmt(s["e2e_s_p50"], 1, 2), fmt(s["accept_length"], 1, 2) + (" *" if s["accept_source"] == "prometheus"
                                                                          else ""),
            fmt(s["errors"], 1, 0),
        )
    table.caption = "accept: tokens per verify round (bonus included); * = from Prometheus counters over the run"
    return table
