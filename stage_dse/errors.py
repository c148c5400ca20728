"""The one exception hierarchy of stage_dse.

``StageDseError`` is the root. ``ConfigError`` is bad user input: its message names the field,
the values and the relation that failed, so the CLI can print it as one line. A plan that is
valid but does not fit in memory is *not* an error: it is a result row with ``status="infeasible"``.
"""

from __future__ import annotations

__all__ = ["ConfigError", "StageDseError"]


class StageDseError(Exception):
    """Root of every error raised on purpose by stage_dse."""


class ConfigError(StageDseError, ValueError):
    """Invalid user input; the message names the field and the violated relation."""
