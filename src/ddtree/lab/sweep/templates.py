"""Launch-template placeholders: ``{name}`` in a ``--launch`` command, filled per config.

A module of its own so that the grid (which validates templates) and the engine profiles (which render the
commands) both use it without importing each other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddtree.errors import ConfigError

# Only ``{identifier}`` is a placeholder, so JSON in a template (vLLM's ``--speculative-config '{"a": 1}'``)
# needs no escaping.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_placeholders(template: str) -> list[str]:
    """The ``{name}`` placeholders of a launch template, in order of first appearance."""
    seen: dict[str, None] = {}
    for name in _PLACEHOLDER.findall(template):
        seen.setdefault(name, None)
    return list(seen)


def render_template(template: str, values: Mapping[str, str]) -> str:
    """Substitute ``{name}`` placeholders; a missing name is a :class:`ConfigError` naming it."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise ConfigError(f"launch template placeholder {{{name}}} has no value; known: {sorted(values)}")
        return values[name]

    return _PLACEHOLDER.sub(substitute, template)
