"""The two refusals the engine raises at start-up (kept apart so config parsing needs nothing
else of the engine)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A checkpoint or engine setting that cannot be served, with the reason."""


class CheckpointError(ValueError):
    """The checkpoint's files do not match the model its config.json describes."""
