"""Error types shared across the package.

``UserError`` is the base of every error that reports a user's mistake (a bad file, flag or value):
entry points print its one-line message and exit instead of showing a traceback. Modules define their
own subclasses (ConfigError, DataConfigError, ...) so callers can still catch them precisely.
"""
from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; the message is one line naming the file or flag and the reason."""


class CheckpointError(UserError):
    """A weights file that cannot be used; the one-line message names the file and the reason."""


class OutputError(UserError):
    """An output that could not be written (disk full, no permission, read-only folder); the message says
    what was not written and what is still intact."""
