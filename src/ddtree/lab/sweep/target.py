"""Where a sweep's requests go: :class:`SweepTarget` (shared by every config) and :class:`Endpoint` (one
config's server).

A module of its own so that the runner, which makes them, and the cells, which send requests to them, both import
it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ddtree.errors import ConfigError
from ddtree.lab.sweep.launcher import LaunchRecord

if TYPE_CHECKING:
    from ddtree.engine.config import EngineConfig

Mode = Literal["inprocess", "url", "launch"]


@dataclass(frozen=True)
class SweepTarget:
    """Where the sweep's requests go, and how they are shaped (shared by every config)."""

    mode: Mode = "inprocess"
    url: str | None = None  # mode "url": the running ddtree server
    engine: str = "auto"  # the bench's engine kind for url/launch (ddtree, sglang, vllm; auto-detected)
    model: str | None = None  # served model name; None = the first of /v1/models
    endpoint: Literal["completions", "chat"] = "completions"
    tokenizer: str | None = None  # the served model's tokenizer when the bench cannot infer it
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every request
    api_key: str | None = None
    timeout_s: float = 600.0
    engine_config: EngineConfig | None = None  # mode "inprocess"; None = the demo pair, sized to the grid
    host: str = "127.0.0.1"  # mode "launch": where the launched server is reached

    def __post_init__(self) -> None:
        if self.mode not in ("inprocess", "url", "launch"):
            raise ConfigError(f"unknown sweep mode {self.mode!r}; use inprocess, url or launch")
        if self.mode == "url" and not self.url:
            raise ConfigError("mode url needs --url of a running ddtree server")
        if "ddtree" in self.extra_body and self.mode != "launch":
            raise ConfigError(
                "--extra-body must not set 'ddtree': the sweep sets the tree settings of each config itself"
            )

    def describe(self) -> dict[str, Any]:
        """The manifest's record of the target (no API key)."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "url": self.url,
            "engine": self.engine,
            "model": self.model,
            "endpoint": self.endpoint,
            "tokenizer": self.tokenizer,
            "extra_body": dict(self.extra_body),
        }
        if self.engine_config is not None:
            cfg = dataclasses.asdict(self.engine_config)
            out["engine_config"] = cfg
        out["description"] = {
            "inprocess": "in-process ddtree engine, settings per request",
            "url": f"ddtree server at {self.url}, settings per request",
            "launch": "one launched server per config",
        }[self.mode]
        return out


@dataclass
class Endpoint:
    """One config's place to send requests."""

    url: str
    engine: str
    model: str | None
    extra_body: dict[str, Any]
    launch: LaunchRecord | None = None
    alive: Callable[[], bool] = lambda: True
    tokenizer: Any = None  # a loaded tokenizer for exact prompt lengths, when the backend has one
