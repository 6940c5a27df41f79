"""Command-line options generated from :class:`~ddtree.engine.config.EngineConfig`'s fields.

Every CLI that builds an engine (``ddtree serve``, ``ddtree generate``, ``ddtree train quality``, ``ddtree lab
sweep`` ...) takes its engine flags from here instead of re-declaring them with copied defaults (the role of
vLLM's ``EngineArgs.add_cli_args``). Usage::

    @engine_options(exclude=("max_batch",), defaults={"max_len": 16384})
    def generate(prompt: str = typer.Option(...), *, engine_config: EngineConfig) -> None:
        ...

The decorated command gets one option per included field (``--max-len``; booleans as ``--cuda-graphs/--no-cuda-graphs``),
with the field's default unless ``defaults`` overrides it, and receives them as one ``engine_config``. A field
added to ``EngineConfig`` needs a line in :data:`HELP` (a test checks), and then reaches every such CLI.

:func:`int_list` is the one parser of comma-separated integer lists (``--budgets 4,8,16``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ddtree.engine.api import TreeSettings, parse_budget
from ddtree.engine.config import EngineConfig
from ddtree.errors import ConfigError

# One help line per EngineConfig field (default_tree has its own options: --method, --budget, ...).
HELP: dict[str, str] = {
    "target": "Target model: a local Hugging Face directory or a hub id (default: the demo target).",
    "draft": "DFlash drafter directory or hub id (default: the demo drafter; 'none': plain decoding only).",
    "device": "auto (cuda when available), cpu, cuda or cuda:N.",
    "dtype": "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16 or float16.",
    "max_batch": "Requests decoding at once (KV slots).",
    "max_len": "Tokens per request, prompt plus completion.",
    "max_budget": "Largest tree budget a request may ask for.",
    "max_block_size": "Largest block size a request may ask for (default: the drafter's trained size).",
    "max_queue": "Requests waiting for a slot before new ones are refused (the server answers 503).",
    "prefill_chunk": "Prompt tokens one prompt writes per prefill step (long prompts are chunked; each slot keeps "
                     "this many positions of cache headroom).",
    "prefill_step_tokens": "A prefill step's size across its prompts, padding included (rows and widest row rounded "
                           "up to powers of two); the loop runs one step a round, so this sets the prefill rate. "
                           "Default 2048 on CUDA, prefill_chunk elsewhere; at least prefill_chunk.",
    "mixed_chunk": "Prompt tokens a decode round carries in its verify forward for requests still prefilling, "
                   "padding included, at most prefill_chunk a prompt (mixed rounds: the extra forward a decoding "
                   "request waits for per round); 0: prefill steps only.",
    "prefill_every": "While requests decode, start prefilling arriving prompts at most once every N rounds, so they "
                     "share one prefill step (a newcomer waits at most N rounds); 1: every round; default 3 on "
                     "CUDA, 1 elsewhere.",
    "kv_memory_fraction": "Size max_batch from this fraction of free device memory instead.",
    "cuda_graphs": "Capture decode rounds as CUDA graphs (CUDA devices only).",
    "prefill_graphs": "With CUDA graphs: also graph prefill chunks that start a prompt (up to 1024 tokens).",
    "gpu_kernels": "Triton kernels on CUDA (fused layer ops, tree attention, vocabulary top-k, walk, compaction).",
    "blas_rule": "Matmuls through cuBLASLt at 32-192 token rows, cuBLAS otherwise (measured on the H200); off: cuBLAS.",
    "exact": "Exact mode: the target computes every token the same way in any batch, chain or tree, so greedy "
             "speculative outputs equal plain decoding bit for bit (slower; needs Triton on CUDA).",
    "draft_fp8": "Run the drafter's layer projections in fp8 (half the bytes a draft reads; lossless, acceptance "
                 "may move; needs a GPU of compute capability >= 8.9).",
    "overlap_rounds": "Queue round n + 1 before reading round n while the batch is unchanged (default: on for CUDA).",
    "cpu_threads": "Torch intra-op threads on a CPU device (process-wide; default: torch's, one per core; 1 on a busy machine).",
    "warmup": "What start-up captures before /health says ready: none, fast (AR + the default tree), full (every "
              "budget bucket, chain, sampled), or DDTree budgets such as 4,15,31 added to fast.",
    "cost_curve": "Round cost curve at start: off, auto (measured once on the engine's grid, every rows and tree "
                  "bucket on a GPU, about 1.5 min there; cached per device, model and config in "
                  "~/.cache/ddtree/cost_curves) or the path of a curve JSON file.",
    "seed": "Engine seed.",
}
_NOT_OPTIONS = ("default_tree",)


def engine_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are command-line options."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in _NOT_OPTIONS]


def engine_options(*, exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
                   names: Mapping[str, str] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a typer command that takes ``engine_config: EngineConfig`` (keyword) with one option per field.

    exclude: fields the command sets itself (they keep EngineConfig's default in ``engine_config``).
    defaults: per-field defaults of this command; ``None`` for a field that has a value in EngineConfig means "not
    given" (the command derives it, e.g. ``max_batch`` from the highest concurrency), and reaches ``engine_config``
    as None, so the command must replace it before validating. names: per-field flag spellings (``{"draft_fp8": "--draft-fp8"}``
    keeps a single flag where a command had one; ``{"warmup": "--engine-warmup"}`` where the command has a flag of the
    field's name)."""
    import typer

    skip, overrides, spellings = set(exclude), dict(defaults or {}), dict(names or {})
    unknown = (skip | set(overrides) | set(spellings)) - {f.name for f in engine_fields()}
    if unknown:
        raise ConfigError(f"engine_options: not EngineConfig option fields: {sorted(unknown)}")
    hints = typing.get_type_hints(EngineConfig)
    chosen = [f for f in engine_fields() if f.name not in skip]
    # the keyword each option arrives as: the field's name, or the identifier of its spelling (--engine-warmup ->
    # engine_warmup), so a command whose own flag has a field's name can still offer the field
    param_names = {f.name: spellings[f.name].split("/")[0].lstrip("-").replace("-", "_") if f.name in spellings
                   else f.name for f in chosen}

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        if "engine_config" not in sig.parameters:
            raise TypeError(f"{fn.__name__} must take an engine_config parameter to use engine_options")
        params = [p for p in sig.parameters.values() if p.name != "engine_config"]
        taken = {p.name for p in params}
        for f in chosen:
            if param_names[f.name] in taken:
                raise TypeError(f"{fn.__name__} declares {param_names[f.name]} itself; exclude {f.name} from "
                                "engine_options or spell its flag otherwise (names=)")
            default = overrides.get(f.name, f.default)
            flag = "--" + f.name.replace("_", "-")
            annotation = hints[f.name]
            if default is None and type(None) not in typing.get_args(annotation):
                annotation = annotation | None  # a command's "not given: derived from its other flags"
            if annotation is bool or annotation == bool | None:
                decls = [spellings.get(f.name, f"{flag}/--no-{flag[2:]}")]
            else:
                decls = [spellings.get(f.name, flag)]
            option = typer.Option(default, *decls, help=HELP[f.name])
            params.append(inspect.Parameter(param_names[f.name], inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {f.name: kwargs.pop(param_names[f.name]) for f in chosen}
            config = EngineConfig(**values)
            _check(config, {f.name: spellings.get(f.name, "--" + f.name.replace("_", "-")).split("/")[0]
                            for f in chosen})
            return fn(**kwargs, engine_config=config)

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return command

    return decorate


def _check(config: EngineConfig, flags: Mapping[str, str]) -> None:
    """EngineConfig's own validation at the command line, its error naming the flag (``Invalid value for
    '--dtype': dtype must be ...``). Fields a command left as None ("derived") are checked at their default."""
    import typer

    derived = {f.name: f.default for f in engine_fields() if getattr(config, f.name) is None
               and f.default is not None and f.default is not dataclasses.MISSING}
    try:
        dataclasses.replace(config, **derived).validated()
    except ConfigError as exc:
        field = str(exc).split(" ", 1)[0]  # EngineConfig.validated's messages open with the field's name
        raise typer.BadParameter(str(exc), param_hint=f"'{flags[field]}'" if field in flags else None) from None


def tree_settings(method: str, budget: str, topk: int | None, block_size: int | None,
                  draft_window: int | None) -> TreeSettings:
    """The :class:`~ddtree.engine.api.TreeSettings` of a command's ``--method``, ``--budget``, ``--topk``,
    ``--block-size`` and ``--draft-window`` (``ddtree generate``'s request, ``ddtree serve``'s default); a budget
    that is neither a count nor ``auto`` is a usage error naming ``--budget``."""
    import typer

    try:
        parsed = parse_budget(budget)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--budget") from None
    return TreeSettings(method=method, budget=parsed, topk=topk, block_size=block_size,  # type: ignore[arg-type]
                        draft_window=draft_window)


@typing.overload
def int_list(text: str, *, name: str = ..., optional: typing.Literal[False] = ...) -> tuple[int, ...]: ...
@typing.overload
def int_list(text: str, *, name: str = ..., optional: bool) -> tuple[int | None, ...]: ...


def int_list(text: str, *, name: str = "value", optional: bool = False) -> tuple[int | None, ...]:
    """``"4, 8,16"`` -> ``(4, 8, 16)``; empty items are skipped. With ``optional``, ``none`` (or ``null``, ``all``)
    is an item too -> ``None`` ("no cap / trained size / whole context", ``"4,none"`` -> ``(4, None)``). Anything
    else is a ConfigError naming ``name`` and the item."""
    values: list[int | None] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item in ("none", "null", "all"):
            if not optional:
                raise ConfigError(f"{name} does not accept {raw.strip()!r}; give integers like 4,8")
            values.append(None)
            continue
        try:
            values.append(int(item))
        except ValueError:
            raise ConfigError(f"{name} must be comma-separated integers{' or none' if optional else ''}: "
                              f"{raw.strip()!r} is not an integer{' or none' if optional else ''} (got {text!r})"
                              ) from None
    return tuple(values)
