"""Engine profiles: a grid point -> the exact command line and environment that serve it on SGLang, vLLM or ddtree.

``ddtree sweep --engine sglang --model M --draft D`` needs no launch template: the profile knows each engine's
flags for the grid's knobs, and refuses, before anything launches, a setting the engine cannot express (naming the
engine and the setting) rather than launching a server that silently measures something else.

Flags per engine (as of late 2026; see ``docs/references.md``, "Engines and clients"):

SGLang (``python -m sglang.launch_server``)
    ``dflash``: ``--speculative-algorithm DFLASH --speculative-draft-model-path D``, the block size as
    ``--speculative-num-draft-tokens N`` (read by old and new builds; newer builds also take
    ``--speculative-dflash-block-size``, engine option ``block_flag=dflash-block-size``), the window as
    ``--speculative-dflash-draft-window-size W``.
    ``ddtree`` (open pull request sgl-project/sglang#29907): ``--speculative-algorithm DDTREE
    --speculative-ddtree-budget B``; there ``--speculative-num-draft-tokens`` is the verify width (budget + 1), so
    the block size goes through ``--speculative-dflash-block-size``. The top-k cap is the environment variable
    ``SGLANG_DDTREE_MAX_TOPK``; "no cap" is written as ``MAX_TOPK = budget``, which is the same tree (only the top
    ``budget`` tokens of a depth can ever enter a tree of ``budget`` nodes). ``SGLANG_DDTREE_DEPTH_BONUS=0`` and
    ``SGLANG_DDTREE_RANK_PROBE=0`` keep the port's heuristics off, so the measured tree is the exact DDTree tree.
    The pull request supports page size 1 and no overlap scheduling only; both are passed explicitly
    (``--page-size 1 --disable-overlap-schedule``) so the command says what runs. Engine option
    ``tree_verify=on`` adds ``--speculative-dflash-tree-verify`` (#31069, GPU top-k inside the graph).
    Dimensions: ``tp`` -> ``--tp-size``, ``dp`` -> ``--dp-size``, ``ep`` -> ``--ep-size``; any other ``name`` ->
    ``--name`` (underscores as dashes), which SGLang's argument parser refuses at start-up when it does not exist.
vLLM (``vllm serve``)
    ``dflash``: ``--speculative-config '{"method": "dflash", "model": D, "num_speculative_tokens": N}'`` with
    ``N = block_size - 1`` (the block is the bonus token plus N masks). ``ddtree`` (open pull request
    vllm-project/vllm#42910): ``"method": "ddtree"`` plus ``"tree_budget": B`` (the key vLLM-derived ports use;
    the pull request may still rename it). vLLM has no draft window and no top-k cap: both are refused unless
    ``none``. It needs N, so "the trained block size" is resolved from the drafter's ``config.json`` when ``--draft``
    is a local directory, and refused otherwise. Dimensions: ``tp`` -> ``--tensor-parallel-size``, ``dp`` ->
    ``--data-parallel-size``; others as for SGLang.
ddtree (``ddtree serve``)
    every knob is a per-request setting, so the sweep runs the pair in process (one load); the profile still
    renders, per config, the ``ddtree serve`` command whose defaults are that config, for the plan and for anyone
    who wants to serve it. Extra dimensions are refused (nothing in ddtree takes them).

The rendered command is a :class:`LaunchCommand`: ``argv`` plus the environment variables to add; ``display`` is
the shell line a person can paste (``ENV=1 python -m ...``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree.errors import ConfigError
from ddtree.lab.sweep.templates import render_template

if TYPE_CHECKING:  # the grid holds a profile, so it imports this module; annotations only here
    from ddtree.lab.sweep.grid import SweepConfig, SweepPoint

PROFILE_ENGINES: tuple[str, ...] = ("sglang", "vllm", "ddtree")
_OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {"tree_verify": ("off", "on"), "block_flag": ("num-draft-tokens", "dflash-block-size")},
    "vllm": {},
    "ddtree": {},
}
_DIM_FLAGS: dict[str, dict[str, str]] = {
    "sglang": {"tp": "--tp-size", "dp": "--dp-size", "ep": "--ep-size"},
    "vllm": {"tp": "--tensor-parallel-size", "dp": "--data-parallel-size"},
}


class InexpressibleSetting(ConfigError):
    """A grid setting the chosen engine has no flag for; raised before anything is launched."""


@dataclass(frozen=True)
class LaunchCommand:
    """One server's command: ``argv`` and the environment variables added to the sweep's own."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def display(self) -> str:
        """The shell line: ``NAME=value ... command args`` (quoted where needed)."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*prefix, shlex.join(self.argv)]).replace("'{port}'", "{port}")  # the plan's placeholder

    def to_dict(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "env": dict(self.env), "display": self.display}


@dataclass(frozen=True)
class EngineProfile:
    """How to launch ``engine`` for every point of a grid.

    ``model`` and ``draft`` are paths or hub ids as the engine takes them; ``extra_args`` are appended verbatim to
    every launch (e.g. ``("--mem-fraction-static", "0.8")``); ``options`` are the profile's own switches (see
    :data:`_OPTIONS`); ``trained_block_size`` is the drafter's block size when known (read from a local drafter)."""

    engine: str
    model: str
    draft: str | None = None
    extra_args: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()
    trained_block_size: int | None = None
    host: str = "127.0.0.1"
    ready_timeout_s: float = 1800.0  # SGLang/vLLM load 6-12 minutes for large models (the user story)
    stop_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.engine not in PROFILE_ENGINES:
            raise ConfigError(f"--engine {self.engine!r} has no launch profile; choose {', '.join(PROFILE_ENGINES)} "
                              "or give a --launch template")
        if not self.model and self.engine != "ddtree":  # ddtree serve defaults to the embedded demo pair
            raise ConfigError(f"--engine {self.engine} needs --model (the target model path or hub id)")
        known = _OPTIONS[self.engine]
        for key, value in self.options:
            if key not in known:
                raise ConfigError(f"--engine-opt {key}: {self.engine} knows "
                                  f"{', '.join(known) or 'no options'}")
            if value not in known[key]:
                raise ConfigError(f"--engine-opt {key}={value}: choose one of {', '.join(known[key])}")

    @classmethod
    def build(cls, engine: str, model: str | None, draft: str | None, *, extra_args: str | None = None,
              options: list[str] | None = None) -> EngineProfile:
        """From CLI strings; reads the drafter's trained block size when ``draft`` is a local directory."""
        parsed = []
        for item in options or []:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--engine-opt expects KEY=VALUE (e.g. tree_verify=on), got {item!r}")
            parsed.append((key.strip(), value.strip()))
        return cls(engine=engine, model=model or "", draft=draft, extra_args=tuple(shlex.split(extra_args or "")),
                   options=tuple(parsed), trained_block_size=trained_block_size(draft))

    def option(self, key: str) -> str:
        return dict(self.options).get(key, _OPTIONS[self.engine][key][0])

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "model": self.model, "draft": self.draft, "extra_args": list(self.extra_args),
                "options": dict(self.options), "trained_block_size": self.trained_block_size}

    # ------------------------------------------------------------------------------------------------ rendering
    def command(self, point: SweepPoint, port: int | str, config: SweepConfig | None = None) -> LaunchCommand:
        """The command serving ``point`` on ``port``; :class:`InexpressibleSetting` when the engine cannot."""
        if point.method != "ar" and not self.draft and self.engine != "ddtree":
            raise InexpressibleSetting(f"{self.engine} cannot serve {point.method} without a drafter: give --draft")
        render = {"sglang": self._sglang, "vllm": self._vllm, "ddtree": self._ddtree}[self.engine]
        return render(point, str(port), config)

    def commands(self, config: SweepConfig, port: int | str = "{port}") -> dict[str, LaunchCommand]:
        """Every point's command, in grid order; the first inexpressible setting raises (nothing has started)."""
        return {p.config_id: self.command(p, port, config) for p in config.points()}

    def _refuse(self, point: SweepPoint, setting: str, why: str) -> InexpressibleSetting:
        return InexpressibleSetting(f"{self.engine} cannot express {setting} (config {point.config_id}): {why}")

    def _dims(self, point: SweepPoint) -> list[str]:
        flags = _DIM_FLAGS.get(self.engine, {})
        out: list[str] = []
        for name, value in point.dims:
            out += [flags.get(name, "--" + name.replace("_", "-")), value]
        return out

    def _sglang(self, point: SweepPoint, port: str, config: SweepConfig | None) -> LaunchCommand:
        argv = ["python", "-m", "sglang.launch_server", "--model-path", self.model, "--host", self.host,
                "--port", port]
        env: list[tuple[str, str]] = []
        block_flag = "--speculative-" + self.option("block_flag")
        if point.method == "dflash":
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(self.draft)]
            if point.block_size is not None:
                argv += [block_flag, str(point.block_size)]
        elif point.method == "ddtree":
            assert point.budget is not None
            argv += ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(self.draft),
                     "--speculative-ddtree-budget", str(point.budget)]
            if point.block_size is not None:
                argv += ["--speculative-dflash-block-size", str(point.block_size)]
            if self.option("tree_verify") == "on":
                argv.append("--speculative-dflash-tree-verify")
            argv += ["--page-size", "1", "--disable-overlap-schedule"]
            topk = point.topk if point.topk is not None else point.budget
            env += [("SGLANG_DDTREE_MAX_TOPK", str(topk)), ("SGLANG_DDTREE_DEPTH_BONUS", "0"),
                    ("SGLANG_DDTREE_RANK_PROBE", "0")]
        if point.method != "ar" and point.draft_window is not None:
            argv += ["--speculative-dflash-draft-window-size", str(point.draft_window)]
        return LaunchCommand(tuple(argv + self._dims(point) + list(self.extra_args)), tuple(env))

    def _vllm(self, point: SweepPoint, port: str, config: SweepConfig | None) -> LaunchCommand:
        argv = ["vllm", "serve", self.model, "--host", self.host, "--port", port]
        if point.method != "ar":
            if point.draft_window is not None:
                raise self._refuse(point, f"draft_window={point.draft_window}",
                                   "vLLM's DFlash has no draft window; use --draft-window none or --engine sglang")
            if point.topk is not None:
                raise self._refuse(point, f"topk={point.topk}",
                                   "vLLM's DDTree (PR #42910) has no top-k cap; use --topk none or --engine sglang")
            block = point.block_size if point.block_size is not None else self.trained_block_size
            if block is None:
                raise self._refuse(point, "block_size=trained",
                                   "vLLM needs num_speculative_tokens and the drafter's trained block size is "
                                   "unknown (--draft is not a local directory); give --block-size explicitly")
            spec: dict[str, Any] = {"method": point.method, "model": self.draft, "num_speculative_tokens": block - 1}
            if point.method == "ddtree":
                spec["tree_budget"] = point.budget
            argv += ["--speculative-config", json.dumps(spec)]
        return LaunchCommand(tuple(argv + self._dims(point) + list(self.extra_args)))

    def _ddtree(self, point: SweepPoint, port: str, config: SweepConfig | None) -> LaunchCommand:
        if point.dims:
            name = point.dims[0][0]
            raise self._refuse(point, f"the dimension {name}", "ddtree serve has no such flag; drop --dim")
        argv = ["ddtree", "serve"] + (["--target", self.model] if self.model else [])
        if self.draft:
            argv += ["--draft", self.draft]
        argv += ["--host", self.host, "--port", port, "--method", point.method]
        for knob, flag in (("budget", "--budget"), ("topk", "--topk"), ("block_size", "--block-size"),
                           ("draft_window", "--draft-window")):
            value = getattr(point, knob)
            if value is not None:
                argv += [flag, str(value)]
        if config is not None:
            argv += ["--max-batch", str(max(config.concurrency)),
                     "--max-len", str(max(max(config.contexts) + config.output_tokens, 1024 + config.gate_max_tokens)
                                      + 16)]
            largest = max((b for b in config.budgets if isinstance(b, int)), default=0)  # "auto" needs no room
            if largest > 64:
                argv += ["--max-budget", str(largest)]
        return LaunchCommand(tuple(argv + list(self.extra_args)))


def trained_block_size(draft: str | None) -> int | None:
    """The block size a z-lab drafter was trained with (top-level ``block_size`` or ``dflash_config.block_size``),
    when ``draft`` is a local directory with a readable ``config.json``; ``None`` otherwise."""
    if not draft:
        return None
    path = Path(draft) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, Mapping):
        return None
    nested = data.get("dflash_config")
    value = (nested or {}).get("block_size") if isinstance(nested, Mapping) else None
    value = value if value is not None else data.get("block_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 2 else None


def build_plan(config: SweepConfig, *, port: int | str | None = None, target: str | None = None,
               draft: str | None = None) -> Plan:
    """The command per config: the profile's, the ``--launch`` template's, or (in process, settings per request)
    the ``ddtree serve`` line whose defaults are that config; raises on an inexpressible setting."""
    shown_port: int | str = port if port is not None else (config.launch.port if config.launch else None) or "{port}"
    commands: dict[str, LaunchCommand | str] = {}
    if config.profile is not None:
        commands.update(config.profile.commands(config, shown_port))
    elif config.launch is not None:
        for point in config.points():
            values = {k: v for k, v in point.template_values().items() if v is not None}
            values.update(port=str(shown_port), config_id=point.config_id)
            commands[point.config_id] = LaunchCommand(tuple(shlex.split(
                render_template(config.launch.template_for(point.method), values))))
    else:
        profile = EngineProfile("ddtree", model=target or "", draft=draft)
        for point in config.points():
            body = json.dumps({"ddtree": point.tree_settings()})
            commands[point.config_id] = (f"in process, per request {body}; served alone: "
                                         f"{profile.command(point, shown_port, config).display}")
    return Plan(config, commands)


@dataclass(frozen=True)
class Plan:
    """What ``--dry-run`` prints and the manifest keeps: per config, its label, command and cells."""

    config: SweepConfig
    commands: dict[str, LaunchCommand | str] = field(default_factory=dict)  # config_id -> command or description

    def to_dict(self) -> dict[str, Any]:
        return {cid: (c.to_dict() if isinstance(c, LaunchCommand) else {"display": c})
                for cid, c in self.commands.items()}

    def lines(self, labels: Mapping[str, str]) -> list[str]:
        cfg = self.config
        cells = len(cfg.bench_cells())
        out = [f"plan: {len(cfg.points())} configs x {cells} benchmark cells (contexts {list(cfg.contexts)}, "
               f"concurrency {list(cfg.concurrency)}, {cfg.repeats} repeat(s))"]
        for index, point in enumerate(cfg.points(), 1):
            cid = point.config_id
            command = self.commands.get(cid)
            shown = command.display if isinstance(command, LaunchCommand) else (command or "")
            out.append(f"[{index}] {labels.get(cid, cid)}  ({cid})")
            if shown:
                out.append(f"    {shown}")
        return out


__all__ = ["PROFILE_ENGINES", "EngineProfile", "InexpressibleSetting", "LaunchCommand", "Plan", "build_plan",
           "trained_block_size"]
