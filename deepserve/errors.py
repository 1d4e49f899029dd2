"""Errors any layer may raise (this module imports nothing of deepserve, so every layer can import it)."""

from __future__ import annotations


class ConfigRefused(ValueError):
    """The model, checkpoint or flags the user gave can't be served, with a message that names what to change.

    Raised only where the input was checked, so a process that fails on one logs that message alone; any other
    exception, ValueErrors included, may be a bug and keeps its traceback. A ValueError, so callers that catch
    refusals by ValueError (the CLI, the server's start-up) still do."""


class FilesMissing(ConfigRefused, FileNotFoundError):
    """A refusal because the checkpoint lacks files (weights, tokenizer): still a FileNotFoundError to callers."""
