"""Typed errors; the gRPC servicer turns each into its status code in one place."""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: an error with a message meant for the client."""

    code_name = "INTERNAL"


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
