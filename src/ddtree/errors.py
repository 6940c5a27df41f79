"""The short exception tree every part raises from.

Messages name the offending value and say what to change, because the person reading them is usually an
inference engineer halfway through a sweep, not the author of the code.

    DDTreeError
    ├── ConfigError          a setting (CLI flag, config file, engine option) is out of range or inconsistent
    ├── ShapeError           a tensor breaks the contract of the call it is passed to (wrong rank, sizes that
    │                        disagree, the wrong device or dtype): a caller's bug, not a setting
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


class ShapeError(DDTreeError, ValueError):
    """A tensor argument breaks its call's contract: wrong rank, sizes that disagree with each other or with the
    model, a tensor on the wrong device or of a dtype the call does not take. The message names the argument, the
    shape it has and the one expected. A ``ValueError`` (as ``ConfigError`` is), so callers that catch bad values
    keep working; distinct from ``ConfigError`` because no setting can fix it: the calling code must."""


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
