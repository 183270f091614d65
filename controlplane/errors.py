"""Typed errors; the gRPC servicer turns each into its status code in one place."""

from __future__ import annotations

import json


class ServiceError(Exception):
    """Base class: an error with a message meant for the client."""

    code_name = "INTERNAL"

    def __str__(self) -> str:
        # What a client sent may come back in the message: a lone surrogate (JSON's "\ud800") as its escape,
        # since neither a gRPC status nor an HTTP body can carry one.
        return super().__str__().encode("utf-8", "backslashreplace").decode("utf-8")


class InvalidRequest(ServiceError):
    code_name = "INVALID_ARGUMENT"


class Overloaded(ServiceError):
    code_name = "RESOURCE_EXHAUSTED"


class NotReady(ServiceError):
    code_name = "UNAVAILABLE"


class StepFailed(ServiceError):
    code_name = "INTERNAL"


class NoLongerFits(ServiceError):
    """A request admitted earlier that the data plane now connected can never hold."""

    code_name = "FAILED_PRECONDITION"


class TemplateBroken(ServiceError):
    """The server's chat template cannot be compiled or failed while rendering."""

    code_name = "FAILED_PRECONDITION"


class StreamNotRead(Overloaded):
    """The client left too much of its stream unread."""


def json_excerpt(value, limit: int) -> str:
    """The first ``limit`` characters of ``value`` as JSON (as ``json.dumps`` writes it), for a message
    that names what a request sent: encoded piece by piece and stopped once that many are out, so a
    huge value costs about ``limit`` characters of work, not a dump of all of it."""
    pieces, size = [], 0
    for piece in json.JSONEncoder().iterencode(value):
        pieces.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(pieces)[:limit]
