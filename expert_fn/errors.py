"""Errors of the expert function runtime, shared by the host (raises) and the client (re-raises).

The host sends the kind of a failure as gRPC trailing metadata (`moeless-error`), so the client
can re-raise the same class with the host's message.
"""

from __future__ import annotations

ERROR_KEY = "moeless-error"  # trailing-metadata key naming the error kind


class ExpertHostError(RuntimeError):
    """An expert host refused or failed a request (base class)."""

    kind = "host"


class ExpertHostUnavailable(ExpertHostError):
    """The host is dead, unreachable, draining or did not answer in time: route elsewhere."""

    kind = "unavailable"


class ReplicaLoadError(ExpertHostError):
    """A replica's weights failed to load; the message names the weight file."""

    kind = "replica_load"


class HostMemoryFull(ExpertHostError):
    """No room for another replica: everything resident is loading or busy."""

    kind = "memory_full"


class BadRequest(ExpertHostError, ValueError):
    """A request the host cannot run (unknown expert, wrong tensor shape)."""

    kind = "bad_request"


ERRORS_BY_KIND = {cls.kind: cls for cls in (ExpertHostError, ExpertHostUnavailable, ReplicaLoadError, HostMemoryFull, BadRequest)}


def refuse_unless_serving(health: str) -> None:
    """A data call's first check on every channel: ExpertHostUnavailable unless the host's health is
    "serving" (a starting host has nothing to run yet; a draining one finishes only what it runs)."""
    if health != "serving":
        raise ExpertHostUnavailable(f"expert host is {health}; route to another host")
