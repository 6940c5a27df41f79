"""Predicted tok/s for every setting at every concurrency: replay's acceptance times a measured cost curve.

The model (stated, because every number it gives rests on it): a benchmark cell is ``num_requests`` requests of a
``context``-token prompt and ``max_tokens`` completion tokens, at most ``concurrency`` in flight (the bench's closed
loop: a finished request's place goes to the next one), on one engine whose loop alternates

* a **prefill step** when admitted requests still have prompt tokens and one is due: the scheduler's rule
  (:func:`ddtree.engine.prefill_budget.step_takes`: at most ``prefill_chunk`` tokens a prompt, in arrival order, as
  many prompts as ``step_tokens`` holds with the step's padding; while others decode, arrivals start at most once
  every ``prefill_every`` rounds unless a prompt is past its first chunk or the waiting prompts hold a chunk:
  :meth:`ddtree.engine.prefill_steps.PrefillSteps._prefill_due`), costing
  :meth:`~ddtree.engine.cost_curve.CostCurve.prefill_step_seconds` of its rows x widest row (what it computes; zero
  when the curve has no prefill points; said in the result) after the mean of its chunks' offsets in their prompts
  (the keys they attend over, priced where the curve has points after a context); a request whose prompt completes gets its first
  token from it and decodes from then on;
* a **decode round** for every decoding request: ``rows`` = those requests, ``kv_len`` = the keys the verify
  reads (the furthest root's position, prompt + tokens so far - 1, plus ``budget + 1``), each row committing the next count of its
  replayed sequence (:func:`ddtree.lab.replay.predict.predict`'s per-round commits), costing
  ``round_seconds(rows, budget, kv_len)``, with ``budget`` the setting's tree nodes past the root (AR 0, the DFlash
  chain its depth, DDTree its budget; budget auto the size the engine's own chooser takes for that round's rows,
  and each row's commits those of that size: :mod:`ddtree.lab.replay.auto`);
* a **finished request's place** frees one iteration after its last round (the engine reads a round in the
  iteration after it queued it, and admits into the freed slot in the one after that); with overlapping rounds
  (``overlap_rounds``, on with CUDA) its row also rides in the round queued before that read, priced and committing
  nothing (the follow-up's rows are those not yet known to be finished).

Predicted tok/s = completion tokens of all requests / the summed step times (the bench's output tok/s: tokens over
first request sent to last one finished). In steady state this is the plain formula: committed tokens per round x
rows / round_seconds(rows, budget, kv_len). Not modelled: the host work between rounds that the curve's rounds do
not contain (emitting tokens, detokenizing, the HTTP server and client of an in-process sweep sharing the same
cores), so on a CPU the prediction is an upper bound whose error grows with the share of that work; on CUDA the
engine overlaps it with the device.

Request ``i`` of a cell replays the trace sequence given for it (the cell's own prompts when the trace was recorded
from them, :func:`cell_sequences`), else the trace's sequences in turn.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddtree.engine.auto_budget import AUTO
from ddtree.engine.config import resolve_prefill_every
from ddtree.engine.cost_curve import CostCurve
from ddtree.engine.prefill_budget import resolve_step_tokens, step_takes
from ddtree.errors import ConfigError
from ddtree.lab.replay.predict import Prediction, Setting

if TYPE_CHECKING:
    from ddtree.lab.replay.auto import AutoAnchors

# the file's schema, and its name inside a sweep's run directory, where `ddtree report` shows it beside the measured
from ddtree.lab.report.predicted import PREDICTED_FILE, TOK_S_SCHEMA


@dataclass(frozen=True)
class CellPrediction:
    """Predicted numbers of one (setting, context, concurrency) cell."""

    config: str  # Setting.label
    method: str
    budget: int | str | None  # "auto": budget auto
    topk: int | None
    context: int
    concurrency: int
    num_requests: int  # per run (repeat)
    max_tokens: int
    tok_s: float  # completion tokens / (round seconds + prefill seconds), the mean over the cell's runs
    accept_length: float  # completion tokens per verify round of the replayed sequences
    rounds: int  # decode rounds the engine runs (batched: one round serves every row)
    round_seconds: float  # summed round times
    prefill_seconds: float  # summed prefill step times (0 without prefill points)
    extrapolated: bool  # some round or prefill step fell outside the curve's grid
    auto_budgets: dict[int, int] | None = None  # budget auto: row-rounds per size chosen (the engine's auto_budgets)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def round_budget(setting: Setting, depth: int) -> int:
    """Tree nodes past the root a round of ``setting`` verifies: AR 0, the chain its depth, DDTree its budget."""
    if setting.method == "ar":
        return 0
    if setting.method == "dflash":
        return depth
    return int(setting.budget)


def _device_type(curve: CostCurve) -> str:
    """The engine's device type for a curve measured on ``curve.device`` ("cpu", else a CUDA device's name)."""
    return "cpu" if curve.device == "cpu" else "cuda"


def curve_step_tokens(curve: CostCurve, prefill_chunk: int, step_tokens: int | None) -> int:
    """The step size an engine on the curve's device used: ``step_tokens``, or the engine's default there."""
    return resolve_step_tokens(step_tokens, prefill_chunk, _device_type(curve))


def curve_overlap(curve: CostCurve, overlap_rounds: bool | None) -> bool:
    """Whether an engine on the curve's device queued each round before reading the one in flight:
    ``overlap_rounds``, or the engine's default there (``EngineConfig.overlap_rounds``: on with CUDA)."""
    return _device_type(curve) == "cuda" if overlap_rounds is None else overlap_rounds


def curve_prefill_every(curve: CostCurve, prefill_every: int | None) -> int:
    """How often an engine on the curve's device started arrivals' prefill while others decoded:
    ``prefill_every``, or the engine's default there (``EngineConfig.prefill_every``: 3 on CUDA, 1 on the CPU)."""
    return resolve_prefill_every(prefill_every, _device_type(curve))


class RoundModel(Protocol):
    """What a cell's decode rounds verify and commit (:func:`closed_loop`): :class:`FixedRounds` for a fixed
    setting, :class:`ddtree.lab.replay.auto.AutoRounds` for budget auto."""

    keeps_context: bool  # a round at budget 0 keeps the drafter's context (auto's no tree), priced as such

    @property
    def budgets(self) -> dict[int, int]:
        """Row-rounds per size where the model chooses sizes (budget auto); empty for one fixed budget."""
        ...

    def round(self, requests: Sequence[int], done: Sequence[int],
              price: Callable[[int], float]) -> tuple[int, list[int]]:
        """(The round's budget, the tokens each of ``requests`` commits); ``done[i]``: completion tokens request
        ``requests[i]`` has; ``price(b)``: the curve's seconds for this round at budget ``b``."""
        ...


class FixedRounds:
    """A fixed setting's rounds: request ``i`` commits ``commits[i]`` round after round, at one budget."""

    keeps_context = False

    def __init__(self, commits: Sequence[Sequence[int]], budget: int) -> None:
        self.commits, self.budget = commits, budget
        self.steps = [0] * len(commits)

    @property
    def budgets(self) -> dict[int, int]:
        return {}  # one fixed budget

    def round(self, requests: Sequence[int], done: Sequence[int],
              price: Callable[[int], float]) -> tuple[int, list[int]]:
        out = []
        for i, d in zip(requests, done, strict=True):
            if self.steps[i] >= len(self.commits[i]):
                raise ConfigError(f"request {i}'s replayed sequence ends after {d} tokens")
            out.append(self.commits[i][self.steps[i]])
            self.steps[i] += 1
        return self.budget, out


@dataclass(frozen=True)
class LoopResult:
    """One simulated run of a cell."""

    round_seconds: float
    prefill_seconds: float
    rounds: int  # decode rounds (one serves every decoding row)
    row_rounds: int  # verify rounds summed over the requests (accept length = tokens / row_rounds)
    extrapolated: bool  # a round or prefill step read the curve outside its grid
    steps: tuple[tuple[int, int], ...] = ()  # per prefill step: (decode rounds run before it, prompts it took)


def closed_loop(curve: CostCurve, requests: int, model: RoundModel, *, context: int, concurrency: int,
                max_tokens: int, prefill_chunk: int = 512, step_tokens: int | None = None,
                prefill_every: int | None = None, overlap_rounds: bool | None = None) -> LoopResult:
    """Run the module's model for one cell of ``requests`` requests whose rounds ``model`` gives (the first token
    of each comes from its prefill).

    Each engine step, as the scheduler's loop: requests the closed loop has sent take free places; one prefill
    step takes prompt tokens of the admitted requests in arrival order (``prefill_chunk`` a prompt, ``step_tokens``
    a step, None: the engine's default on the curve's device; a request whose prompt completes decodes from this
    step on) where one is due (:func:`_prefill_due`; ``prefill_every`` None: the engine's default on the curve's
    device); then one round of every decoding request. A request that finishes frees its place an iteration later
    (the engine reads a round in the iteration after it queued it), and with ``overlap_rounds`` (None: the
    engine's default on the curve's device, on with CUDA) its row rides, wasted, in the round queued before that
    read. With the engine's rounds launched from the host after each read (overlap off) this is its schedule round
    for round (tests/lab/replay/test_replay_schedule.py); with follow-ups it is the schedule of the follow-ups the
    engine queues at a steady load."""
    if concurrency < 1 or requests < 1:
        raise ConfigError(f"a cell needs concurrency >= 1 and at least one request, got {concurrency}, {requests}")
    if prefill_chunk < 1:
        raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    step_tokens = curve_step_tokens(curve, prefill_chunk, step_tokens)
    every = curve_prefill_every(curve, prefill_every)
    if every < 1:
        raise ConfigError(f"prefill_every must be >= 1, got {every}")
    overlap = curve_overlap(curve, overlap_rounds)
    since_step = 0  # rounds since the last prefill step (the scheduler's _rounds_queued - _prefill_round)
    budget = 0  # the last round's (a round of finished rows alone keeps it, as a follow-up does)
    waiting = deque(range(requests))
    prefilling: deque[list[int]] = deque()  # [request, prompt tokens left]
    decoding: dict[int, int] = {}  # request -> tokens committed
    # Requests that finished in the last round: the engine reads a round in the iteration after it queued it, so
    # their places free one iteration later, and with overlapping rounds the round queued before that read still
    # carries their rows (wasted, priced, committing nothing).
    held: list[int] = []
    round_s = prefill_s = 0.0
    rounds = row_rounds = 0
    steps: list[tuple[int, int]] = []
    extrapolated = False
    while waiting or prefilling or decoding or held:
        while waiting and len(prefilling) + len(decoding) + len(held) < concurrency:
            prefilling.append([waiting.popleft(), context])
        if prefilling and _prefill_due(prefilling, context, bool(decoding or held), since_step, every, prefill_chunk):
            since_step = 0
            takes = step_takes([entry[1] for entry in prefilling], chunk=prefill_chunk, step_tokens=step_tokens)
            # the keys of their prompts the chunks attend over: a take-weighted mean of where each chunk starts
            after = sum(take * (context - entry[1]) for entry, take in zip(prefilling, takes, strict=False))
            after /= max(sum(takes), 1)
            steps.append((rounds, len(takes)))
            for entry, take in zip(prefilling, takes, strict=False):
                entry[1] -= take
            step = len(takes) * max(takes)
            cost = curve.prefill_step_seconds(step, after)
            if cost is not None:
                prefill_s += cost
                extrapolated |= not curve.prefill_tokens[0] <= step <= curve.prefill_tokens[-1]
            while prefilling and prefilling[0][1] == 0:
                decoding[prefilling.popleft()[0]] = 1
        rows = [i for i, done in decoding.items() if done < max_tokens]
        wasted = len(held) if overlap else 0  # rows whose request finished on the round before (follow-ups)
        if rows or wasted:
            # the keys the verify reads: the furthest root's position (prompt + tokens so far - 1) + budget + 1
            reach = context + max((decoding[i] for i in rows), default=max_tokens) - 1
            keeps = model.keeps_context

            def price(b: int, n: int = len(rows) + wasted, reach: int = reach, keeps: bool = keeps) -> float:
                return curve.round_seconds(n, b, reach + b + 1, keeps_context=keeps)

            if rows:
                budget, commits = model.round(rows, [decoding[i] for i in rows], price)
            else:  # only finished rows: the follow-up the engine queued before it read that they finished
                commits = []
            round_s += price(budget)
            extrapolated |= not curve.covers(len(rows) + wasted, budget, reach + budget + 1)
            rounds += 1
            since_step += 1
            row_rounds += len(rows)
            for i, n in zip(rows, commits, strict=True):
                decoding[i] += n
        held = [i for i, done in decoding.items() if done >= max_tokens]
        for i in held:
            del decoding[i]
    return LoopResult(round_s, prefill_s, rounds, row_rounds, extrapolated, tuple(steps))


def _prefill_due(prefilling: Sequence[list[int]], context: int, decoding: bool, since_step: int, every: int,
                 prefill_chunk: int) -> bool:
    """Whether the waiting prompts (``[request, tokens left]``, each ``context`` long) take a prefill step now: the
    engine's rule (:meth:`ddtree.engine.prefill_steps.PrefillSteps._prefill_due`): always while nobody decodes or
    with ``every`` 1; else once ``every`` rounds ran since the last step, or when a prompt is past its first chunk,
    or when the waiting prompts hold a whole chunk."""
    if every <= 1 or not decoding:
        return True
    if any(left < context for _, left in prefilling):
        return True
    if sum(left for _, left in prefilling) >= prefill_chunk:
        return True
    return since_step >= every


def simulate_cell(curve: CostCurve, commits: Sequence[Sequence[int]], *, context: int, concurrency: int,
                  max_tokens: int, budget: int, prefill_chunk: int = 512, step_tokens: int | None = None,
                  prefill_every: int | None = None,
                  overlap_rounds: bool | None = None) -> tuple[float, float, int, bool]:
    """:func:`closed_loop` for a fixed setting: ``commits[i]``, request i's tokens committed per decode round, at
    ``budget``. Returns (round seconds, prefill seconds, rounds, extrapolated)."""
    if not commits:
        raise ConfigError(f"a cell needs concurrency >= 1 and at least one request, got {concurrency}, 0")
    out = closed_loop(curve, len(commits), FixedRounds(commits, budget), context=context, concurrency=concurrency,
                      max_tokens=max_tokens, prefill_chunk=prefill_chunk, step_tokens=step_tokens,
                      prefill_every=prefill_every, overlap_rounds=overlap_rounds)
    return out.round_seconds, out.prefill_seconds, out.rounds, out.extrapolated


def predict_cells(predictions: Sequence[Prediction], curve: CostCurve, *, depth: int, contexts: Sequence[int],
                  concurrency: Sequence[int], num_requests: int | Mapping[int, int], max_tokens: int,
                  sequences: Mapping[tuple[int, int], Sequence[int]] | None = None,
                  prefill_chunk: int = 512, step_tokens: int | None = None, prefill_every: int | None = None,
                  overlap_rounds: bool | None = None, auto: AutoAnchors | None = None) -> list[CellPrediction]:
    """Every setting of ``predictions`` (which must carry per-round ``commits``) at every (context, concurrency),
    then budget auto's cells where ``auto`` is given (its rounds replayed by the engine's chooser inside the loop:
    :mod:`ddtree.lab.replay.auto`).

    num_requests: requests per run of a cell, one number or one per concurrency; sequences: the trace sequences
    each (context, concurrency) cell's requests replay, in request order, repeat after repeat (a multiple of the
    requests: one simulated run per repeat, tok/s their mean as the bench reports it; otherwise one run whose
    requests take the sequences in turn; default: all of them); prefill_chunk, step_tokens, prefill_every,
    overlap_rounds: the engine's (:func:`closed_loop`; None: its default on the curve's device)."""
    from ddtree.lab.replay.auto import AutoRounds

    per_setting: list[tuple[Setting, Callable[[list[int]], RoundModel]]] = []
    for pred in predictions:
        per_seq = [s.get("commits") for s in pred.per_sequence]
        if any(c is None for c in per_seq):
            raise ConfigError("predict_cells needs predictions with per-round commits (replay.predict's output)")
        budget = round_budget(pred.setting, depth)
        per_setting.append((pred.setting, lambda run, per_seq=per_seq, budget=budget:
                            FixedRounds([per_seq[s] for s in run], budget)))
    if auto is not None:
        per_setting.append((Setting("ddtree", AUTO, auto.topk), lambda run: AutoRounds(auto, run)))
    count = len(predictions[0].per_sequence) if predictions else auto.num_sequences if auto is not None else 0
    out = []
    for setting, model_for in per_setting:
        for ctx in contexts:
            for conc in concurrency:
                n = num_requests[conc] if isinstance(num_requests, Mapping) else int(num_requests)
                chosen = list((sequences or {}).get((ctx, conc)) or range(count))
                # a cell's prompts, repeat after repeat (n each): every repeat is its own run, as the bench runs them
                if len(chosen) % n == 0:
                    runs = [chosen[i : i + n] for i in range(0, len(chosen), n)]
                else:
                    runs = [[chosen[i % len(chosen)] for i in range(n)]]
                speeds, round_s, prefill_s, rounds, row_rounds, extra = [], 0.0, 0.0, 0, 0, False
                sizes: dict[int, int] = {}
                for run in runs:
                    model = model_for(run)
                    res = closed_loop(curve, len(run), model, context=ctx, concurrency=conc, max_tokens=max_tokens,
                                      prefill_chunk=prefill_chunk, step_tokens=step_tokens,
                                      prefill_every=prefill_every, overlap_rounds=overlap_rounds)
                    spent = res.round_seconds + res.prefill_seconds
                    speeds.append(n * max_tokens / spent if spent > 0 else math.inf)
                    round_s, prefill_s = round_s + res.round_seconds, prefill_s + res.prefill_seconds
                    rounds, row_rounds, extra = rounds + res.rounds, row_rounds + res.row_rounds, extra or res.extrapolated
                    for b, c in model.budgets.items():
                        sizes[b] = sizes.get(b, 0) + c
                out.append(CellPrediction(
                    config=setting.label, method=setting.method,
                    budget=setting.budget if setting.method == "ddtree" else None, topk=setting.topk,
                    context=ctx, concurrency=conc, num_requests=n, max_tokens=max_tokens,
                    tok_s=sum(speeds) / len(speeds),  # the bench's cell: the mean of its runs' tok/s
                    accept_length=len(runs) * n * max_tokens / row_rounds if row_rounds else 0.0,
                    rounds=rounds, round_seconds=round_s, prefill_seconds=prefill_s, extrapolated=extra,
                    auto_budgets={b: sizes[b] for b in sorted(sizes)} if sizes else None))
    return out


def predicted_document(cells: Sequence[CellPrediction], *, curve: CostCurve, curve_path: str | None,
                       trace: Mapping[str, Any], prefill_chunk: int, step_tokens: int | None = None,
                       prefill_every: int | None = None, overlap_rounds: bool | None = None) -> dict[str, Any]:
    """The JSON ``ddtree replay predict --cost-curve`` writes (``predicted.json`` in a run directory)."""
    return {
        "schema": TOK_S_SCHEMA,
        "model": ("closed loop; per engine step: one prefill step where due (prefill_chunk tokens a prompt, rows x "
                  "widest row within prefill_step_tokens, powers of two; while others decode at most once every "
                  "prefill_every rounds unless a prompt is past its first chunk or the waiting prompts hold a chunk), "
                  "then one round of every decoding request at round_seconds(rows, budget, keys read: furthest root "
                  "+ budget + 1); a finished request's place frees an iteration later, and with overlap_rounds its "
                  "row rides, wasted, in the next round; host work between rounds not modelled "
                  "(ddtree.lab.replay.throughput)"),
        "prefill_modelled": bool(curve.prefill_tokens),
        "prefill_chunk": prefill_chunk,
        "prefill_step_tokens": curve_step_tokens(curve, prefill_chunk, step_tokens),
        "prefill_every": curve_prefill_every(curve, prefill_every),
        "overlap_rounds": curve_overlap(curve, overlap_rounds),
        "trace": dict(trace),
        "cost_curve": {"path": curve_path, "device": curve.device, "model": curve.model, "rows": list(curve.rows),
                       "budgets": list(curve.budgets), "kv_lens": list(curve.kv_lens)},
        "cells": [c.to_dict() for c in cells],
    }


@dataclass(frozen=True)
class SweepCells:
    """A sweep run's benchmark cells as its manifest declares them (what :func:`predict_cells` needs)."""

    contexts: tuple[int, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    num_requests: dict[int, int]  # per concurrency
    repeats: int
    seed: int
    text: str
    tokenizer: str | None  # the served model's tokenizer (None: the demo pair's)
    prefill_chunk: int
    prefill_step_tokens: int | None  # None: the engine's default on its device
    max_budget: int  # the engine's (bounds budget auto's sizes)
    prefill_every: int | None = None  # None: the engine's default on its device
    overlap_rounds: bool | None = None  # None: the engine's default on its device

    @classmethod
    def from_run(cls, run_dir: Path) -> SweepCells:
        from ddtree.engine.config import EngineConfig
        from ddtree.lab.bench.workload import Workload
        from ddtree.lab.sweep.layout import RunLayout, read_json

        manifest = read_json(RunLayout(Path(run_dir)).manifest_path)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("grid"), dict):
            raise ConfigError(f"{run_dir} has no sweep manifest (manifest.json with a grid); give a run directory "
                              f"`ddtree sweep` wrote")
        grid, target = manifest["grid"], manifest.get("target") or {}
        engine = target.get("engine_config") or {}
        workload = Workload(contexts=tuple(grid["contexts"]), concurrency=tuple(grid["concurrency"]),
                            output_tokens=int(grid["output_tokens"]), num_requests=grid.get("num_requests"),
                            repeats=int(grid.get("repeats") or 1), seed=int(grid.get("seed") or 0),
                            text=str(grid.get("prompt_text") or "words")).validated()
        return cls(workload.contexts, workload.concurrency, workload.output_tokens,
                   {c: workload.requests_for(c) for c in workload.concurrency}, workload.repeats, workload.seed,
                   workload.text, target.get("tokenizer") or engine.get("target"),
                   int(engine.get("prefill_chunk") or 512),
                   None if engine.get("prefill_step_tokens") is None else int(engine["prefill_step_tokens"]),
                   int(engine.get("max_budget") or EngineConfig.max_budget),
                   None if engine.get("prefill_every") is None else int(engine["prefill_every"]),
                   None if engine.get("overlap_rounds") is None else bool(engine["overlap_rounds"]))

    def prompts(self, tokenizer: Any) -> dict[tuple[int, int], list[list[int]]]:
        """Every cell's prompt ids, all repeats in order, exactly as the bench builds them (same seed and tags)."""
        from ddtree.lab.bench.workload import build_prompts

        out = {}
        for ctx in self.contexts:
            for conc in self.concurrency:
                n = self.num_requests[conc]
                out[(ctx, conc)] = [list(p.ids) for r in range(self.repeats)
                                    for p in build_prompts(tokenizer, ctx, n, phase=f"r{r}-", seed=self.seed,
                                                           context=ctx, concurrency=conc, text=self.text)]
        return out


def cell_sequences(trace_prompts: Sequence[Sequence[int]],
                   cells: Mapping[tuple[int, int], Sequence[Sequence[int]]]) -> dict[tuple[int, int], list[int]]:
    """The trace sequence of each cell's prompt (a prompt the trace lacks is skipped; a cell with none left gets
    the trace's sequences of its prompt length, else every sequence, when :func:`predict_cells` falls back)."""
    index = {tuple(p): s for s, p in enumerate(trace_prompts)}
    out = {}
    for key, prompts in cells.items():
        found = [index[tuple(p)] for p in prompts if tuple(p) in index]
        if not found:
            found = [s for s, p in enumerate(trace_prompts) if len(p) == key[0]]
        out[key] = found
    return out


__all__ = ["PREDICTED_FILE", "TOK_S_SCHEMA", "CellPrediction", "SweepCells", "cell_sequences", "predict_cells",
           "predicted_document", "round_budget", "simulate_cell"]
