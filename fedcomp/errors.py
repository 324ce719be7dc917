"""The one error type every decoder raises on bad input."""

from __future__ import annotations


class PayloadError(ValueError):
    """A payload could not be decoded: truncated, corrupted, hostile, or not the expected tensor.

    ``tensor`` names the tensor (empty when the failure is not tied to one, e.g. unparsable
    protobuf), ``reason`` says what was wrong. Catching this one class is enough to reject a
    client's update and go on with the others.
    """

    def __init__(self, tensor: str, reason: str) -> None:
        self.tensor = tensor
        self.reason = reason
        where = f"tensor {tensor!r}" if tensor else "payload"
        super().__init__(f"{where}: {reason}")


class ConfigError(ValueError):
    """A codec or run configuration is invalid; the message names the bad key."""
