"""One sweep cell through the lab's measuring code: a benchmark cell (``run_bench``) or the coding gate
(``run_humaneval``), with request errors turned into :class:`CellFailed` so the sweep records them and goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree.errors import DDTreeError
from ddtree.lab.sweep.grid import SweepConfig, SweepPoint

if TYPE_CHECKING:
    from ddtree.lab.sweep.target import Endpoint, SweepTarget

GATE_CONCURRENCY = 4  # gate requests in flight at once; greedy outputs do not depend on it
# Every gate run (the AR baseline and each speculative config alike) records its tokens and their top-5
# log-probs: the baseline's classify each difference at its first differing token, and asking the same of every
# run keeps the request bodies equal but for the method (and lets any run's record serve as a baseline).
GATE_LOGPROBS = 5


class CellFailed(DDTreeError):
    """A cell finished but its numbers cannot be trusted (request errors); its data goes in the failure record."""

    def __init__(self, message: str, kind: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.data = data


def _bench_target(target: SweepTarget, endpoint: Endpoint) -> Any:
    from ddtree.lab.client import BenchTarget

    return BenchTarget(
        url=endpoint.url,
        engine=endpoint.engine,
        model=endpoint.model,
        endpoint=target.endpoint,
        extra_body=endpoint.extra_body,
        tokenizer=target.tokenizer,
        api_key=target.api_key,
        timeout_s=target.timeout_s,
    )


def run_bench_cell(
    target: SweepTarget, endpoint: Endpoint, config: SweepConfig, point: SweepPoint, context: int, concurrency: int
) -> dict[str, Any]:
    """One (context, concurrency) cell through ``run_bench``; raises :class:`CellFailed` on request errors."""
    from ddtree.lab.bench import Workload, run_bench

    workload = Workload(
        contexts=(context,),
        concurrency=(concurrency,),
        output_tokens=config.output_tokens,
        num_requests=config.num_requests,
        repeats=config.repeats,
        seed=config.seed,
        warmup=config.warmup,
        text=config.prompt_text,
    )
    cells = asyncio.run(
        run_bench(
            _bench_target(target, endpoint),
            workload,
            out_dir=None,
            config=point.to_dict(),
            progress=False,
            tokenizer=endpoint.tokenizer,
        )
    )
    if len(cells) != 1:
        raise CellFailed(f"run_bench returned {len(cells)} cells for one (context, concurrency)", "internal")
    cell = cells[0]
    errors = int((cell.get("summary") or {}).get("errors") or 0)
    if errors:
        messages = [
            str(req.get("error"))
            for run in cell.get("runs") or []
            for req in run.get("requests") or []
            if req.get("error")
        ]
        shown = "; ".join(dict.fromkeys(messages[:20])) or "see the cell data"
        raise CellFailed(f"{errors} request(s) failed: {shown}", "http", cell)
    return cell


def run_gate(
    target: SweepTarget, endpoint: Endpoint, config: SweepConfig, tasks: tuple[str, ...], baseline: Path | None,
    *, near_tie_margin: float | None = None, exact: bool = False,
) -> dict[str, Any]:
    """The coding gate through ``run_humaneval``; greedy, compared with AR's outputs when ``baseline`` is given,
    each differing output classified (near-tie within ``near_tie_margin`` nats, default
    :data:`~ddtree.lab.humaneval.DEFAULT_NEAR_TIE_MARGIN`, or real divergence).

    ``exact``: ``endpoint`` is our engine in exact mode; the result says so (``"exact": true``), and against a
    baseline that was exact too every difference is real (:func:`~ddtree.lab.humaneval.lossless.compare_with_baseline`
    with ``exact``); against any other baseline the classifier decides as usual."""
    from ddtree.lab.humaneval import DEFAULT_NEAR_TIE_MARGIN, run_humaneval
    from ddtree.lab.humaneval.lossless import compare_with_baseline
    from ddtree.lab.sweep.layout import read_json

    margin = DEFAULT_NEAR_TIE_MARGIN if near_tie_margin is None else near_tie_margin
    result = run_humaneval(
        _bench_target(target, endpoint),
        tasks=list(tasks),
        limit=None,
        max_tokens=config.gate_max_tokens,
        out=None,
        baseline=baseline,
        concurrency=GATE_CONCURRENCY,
        logprobs=GATE_LOGPROBS,
        near_tie_margin=margin,
    )
    result["exact"] = exact
    if exact and baseline is not None and (read_json(baseline) or {}).get("exact") is True:
        result["lossless"] = compare_with_baseline(result, baseline, near_tie_margin=margin, exact=True)
    errors = int(result.get("errors") or 0)
    if errors:
        failed = [t.get("task_id") for t in result.get("tasks") or [] if t.get("reason", "").startswith("error")]
        raise CellFailed(f"{errors} gate request(s) failed ({', '.join(map(str, failed)) or 'see data'})", "http", result)
    return result


def resolve_gate_tasks(config: SweepConfig) -> tuple[str, ...]:
    if config.gate_tasks is not None:
        return config.gate_tasks
    from ddtree.lab.humaneval import GATE_TASKS

    return tuple(GATE_TASKS)


__all__ = ["GATE_CONCURRENCY", "GATE_LOGPROBS", "CellFailed", "resolve_gate_tasks", "run_bench_cell", "run_gate"]
