"""The short exception tree every part raises from.

Messages name the offending value and say what to change, because the person reading them is usually an
inference engineer halfway through a sweep, not the author of the code.

    DDTreeError
    ├── ConfigError          a setting (CLI flag, config file, engine option) is out of range or inconsistent
    ├── CheckpointError      a model directory is missing, malformed, or does not match its config
    ├── InvalidRequestError  one request is unacceptable (empty prompt, too long, bad tree settings);
    │                        it fails alone, before taking a KV slot
    └── EngineError          the engine could not run a request (an internal fault confined to that request)
"""

from __future__ import annotations


class DDTreeError(Exception):
    """Base class of every error ddtree raises on purpose."""


class ConfigError(DDTreeError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted range."""


class CheckpointError(DDTreeError):
    """A checkpoint cannot be loaded; the message names the file or tensor and what was expected."""


class InvalidRequestError(DDTreeError, ValueError):
    """A single request is invalid. ``param`` names the request field at fault (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(DDTreeError, RuntimeError):
    """A request failed inside the engine; other requests keep running."""


class QueueFullError(EngineError):
    """The engine's admission queue is full; retry later (the server answers 503 with Retry-After)."""
