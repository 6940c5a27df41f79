"""The sweep grid: which configurations are measured, on which workload, and with which quality gate.

Terms
-----
config (a :class:`SweepPoint`)
    One setting of the tree knobs (``method``, ``budget``, ``topk``, ``block_size``, ``draft_window``) plus the
    values of any extra launch-template dimensions (``{tp}``, ``{ep}``, ...). Its ``config_id`` names its directory
    and reads like the settings, e.g. ``ddtree-b8-k4-bs16-w2048`` or ``ar-tp8``.
cell
    One measurement of one config: a benchmark cell (one context x one concurrency) or the coding gate.
baselines
    The plain decoder (``ar``) and the DFlash chain (``dflash``, one per block size x draft window) are always in
    the grid: every recommendation is a speed-up over them, and AR's greedy outputs are the lossless reference.

``None`` means "no cap" for ``topk``, "the drafter's trained size" for ``block_size`` and "the whole context" for
``draft_window``; it is spelled ``none`` on the command line and in config files.

Example::

    SweepConfig(budgets=(4, 8), topks=(4, None)).points()
    -> ar, dflash-bstrained-wnone, ddtree-b4-k4-bstrained-wnone, ddtree-b4-knone-bstrained-wnone,
       ddtree-b8-k4-bstrained-wnone, ddtree-b8-knone-bstrained-wnone
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.engine.api import METHODS
from ddtree.errors import ConfigError
from ddtree.lab.sweep.profiles import EngineProfile
from ddtree.lab.sweep.templates import render_template, template_placeholders

# Names a launch template may use besides the extra dimensions: the tree knobs, the port the launcher picks and
# the config id (handy for per-config output paths of the launched engine).
TREE_FIELDS: tuple[str, ...] = ("method", "budget", "topk", "block_size", "draft_window")
RESERVED_PLACEHOLDERS: frozenset[str] = frozenset({*TREE_FIELDS, "port", "config_id"})
# Which knobs each method actually uses; the others are ``None`` on its points so they are never varied for it.
METHOD_FIELDS: dict[str, tuple[str, ...]] = {
    "ar": (),
    "dflash": ("block_size", "draft_window"),
    "ddtree": ("budget", "topk", "block_size", "draft_window"),
}
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _fmt(value: int | None, none: str = "none") -> str:
    return none if value is None else str(value)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "_", text).strip("_") or "_"


@dataclass(frozen=True)
class SweepPoint:
    """One configuration of the grid (see the module docstring for ``None``)."""

    method: str
    budget: int | str | None = None  # "auto": chosen per round by the engine
    topk: int | None = None
    block_size: int | None = None
    draft_window: int | None = None
    dims: tuple[tuple[str, str], ...] = ()  # extra launch-template dimensions, in grid order

    @property
    def config_id(self) -> str:
        parts = [self.method]
        if self.method == "ddtree":
            parts += [f"b{self.budget}", f"k{_fmt(self.topk)}"]
        if self.method in ("ddtree", "dflash"):
            parts += [f"bs{_fmt(self.block_size, 'trained')}", f"w{_fmt(self.draft_window)}"]
        parts += [f"{name}{_slug(value)}" for name, value in self.dims]
        return "-".join(parts)

    @property
    def is_baseline(self) -> bool:
        return self.method != "ddtree"

    def tree_settings(self) -> dict[str, Any]:
        """The per-request ``{"ddtree": {...}}`` payload: every knob the method uses, ``None`` included, so the
        server's defaults never leak into a measured config."""
        out: dict[str, Any] = {"method": self.method}
        for name in METHOD_FIELDS[self.method]:
            out[name] = getattr(self, name)
        return out

    def template_values(self) -> dict[str, str | None]:
        """Values for a launch template; ``None`` where this method has no such knob or the knob is unset."""
        values: dict[str, str | None] = {"method": self.method}
        for name in TREE_FIELDS[1:]:
            value = getattr(self, name)
            values[name] = None if value is None else str(value)
        values.update(dict(self.dims))
        return values

    def to_dict(self) -> dict[str, Any]:
        return {
            "config_id": self.config_id,
            "method": self.method,
            "budget": self.budget,
            "topk": self.topk,
            "block_size": self.block_size,
            "draft_window": self.draft_window,
            "dims": dict(self.dims),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepPoint:
        return cls(
            method=data["method"],
            budget=data.get("budget"),
            topk=data.get("topk"),
            block_size=data.get("block_size"),
            draft_window=data.get("draft_window"),
            dims=tuple((str(k), str(v)) for k, v in (data.get("dims") or {}).items()),
        )


@dataclass(frozen=True)
class LaunchSpec:
    """Command templates that start an external engine per configuration (``--launch``).

    ``command`` serves every method unless ``ar`` / ``dflash`` give their own template (SGLang's plain decoder,
    for instance, is the same command without the speculative flags). A template must not use a knob its method
    lacks (``{budget}`` in the AR template), nor a knob the grid leaves at ``None``: each launched server must be
    told exactly the setting it is measured as."""

    command: str
    ar: str | None = None
    dflash: str | None = None
    ready_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    port: int | None = None  # the port a template without ``{port}`` listens on

    def template_for(self, method: str) -> str:
        specific = {"ar": self.ar, "dflash": self.dflash}.get(method)
        return specific if specific is not None else self.command

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SweepConfig:
    """Everything a sweep measures: the grid, the benchmark matrix and the coding gate. Validated on build."""

    name: str = "custom"  # preset name or config-file stem; the default run directory starts with it
    methods: tuple[str, ...] = ("ddtree",)
    budgets: tuple[int | str, ...] = (8,)  # "auto": the engine chooses per round (ddtree.engine.auto_budget)
    topks: tuple[int | None, ...] = (None,)
    block_sizes: tuple[int | None, ...] = (None,)
    draft_windows: tuple[int | None, ...] = (None,)
    dims: tuple[tuple[str, tuple[str, ...]], ...] = ()  # extra launch dimensions: (("tp", ("1", "8")),)
    contexts: tuple[int, ...] = (60, 1024)
    concurrency: tuple[int, ...] = (1, 8)
    output_tokens: int = 128
    num_requests: int | None = None  # per cell; None = the bench default (at least 2 x concurrency)
    repeats: int = 1
    seed: int = 0
    prompt_text: str = "words"  # bench prompt filler: "words" or "code" (held-out stdlib Python)
    # An untimed run shaped like each cell before it is timed, so graph captures and kernel compilations a shape
    # meets first are not measured. False only where nothing is captured or compiled on first use (the CPU).
    warmup: bool = True
    gate_tasks: tuple[str, ...] | None = None  # HumanEval task ids; None = the bench's GATE_TASKS; () = no gate
    gate_max_tokens: int = 512
    # The gate runs our own in-process engine in exact mode (EngineConfig.exact): AR and every speculative config
    # bit-identical by construction, so any difference is a real bug. False: the sweep's engine as it is, and the
    # divergence classifier tells near-ties from real divergences (as it always does for other engines).
    gate_exact: bool = True
    launch: LaunchSpec | None = None
    profile: EngineProfile | None = None  # --engine sglang|vllm|ddtree --model M: flags rendered per config

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, name: str = "custom") -> SweepConfig:
        """Build from a config file's sections: ``[grid]``, ``[dims]``, ``[bench]``, ``[gate]``, ``[launch]``.

        ``None`` may be written ``"none"``; unknown sections or keys are errors naming them."""
        sections = {"grid", "dims", "bench", "gate", "launch", "name"}
        unknown = sorted(set(data) - sections)
        if unknown:
            raise ConfigError(f"unknown sweep config section(s) {unknown}; known: {sorted(sections)}")
        kwargs: dict[str, Any] = {"name": str(data.get("name", name))}
        grid_keys = {
            "method": "methods",
            "budget": "budgets",
            "topk": "topks",
            "block_size": "block_sizes",
            "draft_window": "draft_windows",
        }
        grid = dict(_section(data, "grid"))
        for key, attr in grid_keys.items():
            for spelling in (key, attr):  # "budget" and "budgets" both read naturally
                if spelling in grid:
                    kwargs[attr] = grid.pop(spelling)
        _no_leftovers("grid", grid, [*grid_keys, *grid_keys.values()])
        dims = _section(data, "dims")
        kwargs["dims"] = tuple((str(k), tuple(str(v) for v in _as_list(vs, f"dims.{k}"))) for k, vs in dims.items())
        bench = dict(_section(data, "bench"))
        for key in ("contexts", "concurrency", "output_tokens", "num_requests", "repeats", "seed", "warmup"):
            if key in bench:
                kwargs[key] = bench.pop(key)
        if "text" in bench:
            kwargs["prompt_text"] = bench.pop("text")
        _no_leftovers("bench", bench, ["contexts", "concurrency", "output_tokens", "num_requests", "repeats", "seed",
                                       "text", "warmup"])
        gate = dict(_section(data, "gate"))
        if "tasks" in gate:
            kwargs["gate_tasks"] = gate.pop("tasks")
        if "max_tokens" in gate:
            kwargs["gate_max_tokens"] = gate.pop("max_tokens")
        if "exact" in gate:
            kwargs["gate_exact"] = gate.pop("exact")
        _no_leftovers("gate", gate, ["tasks", "max_tokens", "exact"])
        launch = dict(_section(data, "launch"))
        if launch:
            known = [f.name for f in dataclasses.fields(LaunchSpec)]
            _no_leftovers("launch", {k: v for k, v in launch.items() if k not in known}, known)
            if "command" not in launch:
                raise ConfigError("[launch] needs a 'command' template (e.g. \"ddtree serve --port {port} ...\")")
            kwargs["launch"] = LaunchSpec(**launch)
        return cls(**_coerce(kwargs))

    @classmethod
    def from_file(cls, path: str | Path) -> SweepConfig:
        """Load a ``.toml`` (tomllib) or ``.yaml``/``.yml`` (only if PyYAML is installed) sweep description."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"sweep config file {path} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".toml":
            import tomllib

            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ModuleNotFoundError:
                raise ConfigError(
                    f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the same sections as TOML"
                ) from None
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: invalid YAML: {exc}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        else:
            raise ConfigError(f"sweep config {path}: use a .toml or .yaml file, got {suffix or 'no suffix'!r}")
        return cls.from_mapping(data, name=path.stem)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepConfig:
        """Inverse of :meth:`to_dict` (the manifest's ``grid``)."""
        kwargs = dict(data)
        launch = kwargs.get("launch")
        kwargs["launch"] = LaunchSpec(**launch) if launch else None
        profile = kwargs.get("profile")
        if profile:
            profile = dict(profile)
            profile["extra_args"] = tuple(profile.get("extra_args") or ())
            profile["options"] = tuple((str(k), str(v)) for k, v in (profile.get("options") or {}).items())
            kwargs["profile"] = EngineProfile(**profile)
        else:
            kwargs["profile"] = None
        kwargs["dims"] = tuple((k, tuple(v)) for k, v in (kwargs.get("dims") or {}).items())
        return cls(**_coerce(kwargs))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dims"] = {name: list(values) for name, values in self.dims}
        out["launch"] = self.launch.to_dict() if self.launch else None
        out["profile"] = self.profile.to_dict() if self.profile else None
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out

    def replace(self, **changes: Any) -> SweepConfig:
        """A copy with ``changes`` applied (``None`` values are ignored, so CLI flags left unset keep the base)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **_coerce(changes)) if changes else self

    # ----------------------------------------------------------------------------------------------- the grid
    def points(self) -> list[SweepPoint]:
        """Every configuration, baselines first: AR, then the DFlash chains, then the DDTree settings; each one
        repeated over the extra dimensions."""
        base: list[SweepPoint] = [SweepPoint("ar")]
        for block, window in itertools.product(self.block_sizes, self.draft_windows):
            base.append(SweepPoint("dflash", block_size=block, draft_window=window))
        if "ddtree" in self.methods:
            for budget, topk, block, window in itertools.product(
                self.budgets, self.topks, self.block_sizes, self.draft_windows
            ):
                base.append(SweepPoint("ddtree", budget=budget, topk=topk, block_size=block, draft_window=window))
        names = [name for name, _ in self.dims]
        combos = list(itertools.product(*(values for _, values in self.dims))) or [()]
        return [
            dataclasses.replace(point, dims=tuple(zip(names, combo, strict=True)))
            for combo in combos
            for point in base
        ]

    def knob_values(self, knob: str) -> tuple[int | None, ...]:
        """The grid's values of one tree knob (``budget``, ``topk``, ``block_size``, ``draft_window``)."""
        return {
            "budget": self.budgets,
            "topk": self.topks,
            "block_size": self.block_sizes,
            "draft_window": self.draft_windows,
        }[knob]

    def bench_cells(self) -> list[tuple[int, int]]:
        """(context, concurrency) pairs, in the order they are measured."""
        return list(itertools.product(self.contexts, self.concurrency))

    # ----------------------------------------------------------------------------------------------- checks
    def _validate(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"sweep name must be a non-empty string, got {self.name!r}")
        for method in self.methods:
            if method not in METHODS:
                raise ConfigError(f"unknown method {method!r} in the grid; choose from {', '.join(METHODS)}")
        _check_ints("budget", tuple(b for b in self.budgets if b != "auto"), 1, allow_empty=self.budgets == ("auto",))
        _check_ints("topk", self.topks, 1, allow_none=True)
        _check_ints("block_size", self.block_sizes, 2, allow_none=True)
        _check_ints("draft_window", self.draft_windows, 1, allow_none=True)
        _check_ints("contexts", self.contexts, 1)
        _check_ints("concurrency", self.concurrency, 1)
        _check_ints("output_tokens", (self.output_tokens,), 1)
        _check_ints("repeats", (self.repeats,), 1)
        _check_ints("seed", (self.seed,), 0)
        _check_ints("gate_max_tokens", (self.gate_max_tokens,), 1)
        if not isinstance(self.gate_exact, bool):
            raise ConfigError(f"gate exact must be true or false, got {self.gate_exact!r}")
        if self.num_requests is not None:
            _check_ints("num_requests", (self.num_requests,), 1)
        if self.prompt_text not in ("words", "code"):
            raise ConfigError(f"prompt text must be 'words' or 'code', got {self.prompt_text!r}")
        if not isinstance(self.warmup, bool):
            raise ConfigError(f"bench warmup must be true or false, got {self.warmup!r}")
        for block, window in itertools.product(self.block_sizes, self.draft_windows):
            if block is not None and window is not None and window < block:
                raise ConfigError(
                    f"draft_window {window} is smaller than block_size {block}; the drafter must see at least "
                    "one block of context: raise the window or drop that block size"
                )
        if self.gate_tasks is not None and any(not isinstance(t, str) or not t for t in self.gate_tasks):
            raise ConfigError(f"gate tasks must be HumanEval task ids like 'HumanEval/0', got {self.gate_tasks!r}")
        seen: set[str] = set()
        for name, values in self.dims:
            if not _DIM_NAME.match(name) or name in RESERVED_PLACEHOLDERS:
                raise ConfigError(
                    f"dimension name {name!r} must be an identifier other than {sorted(RESERVED_PLACEHOLDERS)}"
                )
            if name in seen:
                raise ConfigError(f"dimension {name!r} is given twice")
            seen.add(name)
            if not values or any(not isinstance(v, str) or v == "" for v in values):
                raise ConfigError(f"dimension {name!r} needs non-empty string values, got {values!r}")
        if self.launch is not None and self.profile is not None:
            raise ConfigError("give either --launch (a template) or --engine with --model (a profile), not both")
        if self.dims and self.launch is None and self.profile is None:
            raise ConfigError(
                f"extra dimensions {[n for n, _ in self.dims]} only mean something to a launched engine; "
                "give --engine sglang|vllm with --model, or --launch with a template that uses them"
            )
        if self.launch is not None:
            self._validate_launch(self.launch)
        if self.profile is not None:
            self.profile.commands(self)  # an inexpressible setting is refused here, before anything launches

    def _validate_launch(self, launch: LaunchSpec) -> None:
        if launch.ready_timeout_s <= 0 or launch.stop_timeout_s <= 0:
            raise ConfigError("launch timeouts must be > 0 seconds")
        dims = {name for name, _ in self.dims}
        methods = ["ar", "dflash", *(["ddtree"] if "ddtree" in self.methods else [])]
        for method in methods:
            template = launch.template_for(method)
            names = template_placeholders(template)
            flag = {"ar": "--launch-ar", "dflash": "--launch-dflash"}.get(method, "--launch")
            for name in names:
                if name not in RESERVED_PLACEHOLDERS and name not in dims:
                    raise ConfigError(
                        f"launch template placeholder {{{name}}} has no values: give --dim {name}=V1,V2 "
                        "(or a [dims] entry), or remove it from the template"
                    )
                if name in TREE_FIELDS[1:] and name not in METHOD_FIELDS[method]:
                    raise ConfigError(
                        f"the launch template used for {method} configs has {{{name}}}, which {method} does not "
                        f"have; give {flag} with a template for {method}"
                    )
            if "port" not in names and launch.port is None:
                raise ConfigError(
                    f"the launch template for {method} has no {{port}}: add one (the launcher picks a free port) "
                    "or give --port with the port it listens on"
                )
            for knob in METHOD_FIELDS[method]:
                values = self.knob_values(knob)
                if knob in names and None in values:
                    raise ConfigError(
                        f"the launch template for {method} passes {{{knob}}} but the grid has {knob}=none; give "
                        f"explicit {knob} values (the launched server must be told the setting it is measured as)"
                    )
                if knob not in names and len(values) > 1:
                    raise ConfigError(
                        f"the grid varies {knob} ({list(values)}) but the launch template for {method} has no "
                        f"{{{knob}}}, so every launch would be the same server; add {{{knob}}} to {flag}"
                    )


# --------------------------------------------------------------------------------------------------- parsing
def parse_list(text: str, *, what: str, optional: bool = False) -> tuple[int | None, ...]:
    """``"4,8,none"`` -> ``(4, 8, None)``; ``none`` only where ``optional`` (:func:`ddtree.engine.options.int_list`)."""
    from ddtree.engine.options import int_list

    values = int_list(text, name=f"--{what}", optional=optional)
    if not values:
        raise ConfigError(f"--{what} needs at least one value")
    return values


def parse_budgets(text: str) -> tuple[int | str, ...]:
    """``"4,16,auto"`` -> ``(4, 16, "auto")``: budgets as :func:`parse_list` reads them, plus ``auto``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    numbers = [p for p in parts if p != "auto"]
    ints = iter(parse_list(",".join(numbers), what="budget") if numbers else ())
    return tuple("auto" if p == "auto" else next(ints) for p in parts)


def max_int_budget(budgets: Sequence[int | str]) -> int:
    """The largest fixed budget of a grid (0 when it holds only ``auto``): what the engine's max_budget must hold."""
    return max((b for b in budgets if isinstance(b, int)), default=0)


def parse_dim(text: str) -> tuple[str, tuple[str, ...]]:
    """``"tp=1,8"`` -> ``("tp", ("1", "8"))``."""
    name, sep, values = text.partition("=")
    items = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not name.strip() or not items:
        raise ConfigError(f"--dim expects NAME=V1,V2 (e.g. tp=1,8), got {text!r}")
    return name.strip(), items


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"[{key}] must be a table of settings, got {type(value).__name__}")
    return value


def _no_leftovers(section: str, remaining: Mapping[str, Any], known: Iterable[str]) -> None:
    if remaining:
        raise ConfigError(f"unknown key(s) {sorted(remaining)} in [{section}]; known: {sorted(set(known))}")


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (str, int)) or value is None:
        return [value]
    raise ConfigError(f"{what} must be a value or a list of values, got {value!r}")


def _none(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("none", "null", "all"):
        return None
    return value


_TUPLE_FIELDS = ("methods", "budgets", "topks", "block_sizes", "draft_windows", "contexts", "concurrency")


def _coerce(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Lists to tuples, ``"none"`` to ``None``, deduplicated in order (a value given twice is measured once)."""
    out = dict(kwargs)
    for key in _TUPLE_FIELDS:
        if key in out:
            values = [_none(v) for v in _as_list(out[key], key)]
            out[key] = tuple(dict.fromkeys(values))
    if "gate_tasks" in out and out["gate_tasks"] is not None:
        out["gate_tasks"] = tuple(dict.fromkeys(_as_list(out["gate_tasks"], "gate tasks")))
    if "num_requests" in out:
        out["num_requests"] = _none(out["num_requests"])
    if "dims" in out:
        out["dims"] = tuple((str(n), tuple(str(v) for v in vs)) for n, vs in out["dims"])
    return out


def _check_ints(name: str, values: Sequence[Any], lo: int, *, allow_none: bool = False,
                allow_empty: bool = False) -> None:
    if not values and not allow_empty:
        raise ConfigError(f"{name} needs at least one value")
    for value in values:
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            allowed = f"integers >= {lo}" + (" or none" if allow_none else "")
            raise ConfigError(f"{name} must be {allowed}, got {value!r}")


__all__ = [
    "LaunchSpec",
    "SweepConfig",
    "SweepPoint",
    "parse_dim",
    "parse_list",
    "render_template",
    "template_placeholders",
]
