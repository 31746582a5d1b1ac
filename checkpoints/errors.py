"""The one error type the checkpoint package raises for a bad or unreadable checkpoint."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor this loader cannot use; the message names the culprit."""
