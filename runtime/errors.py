"""One exception hierarchy, mapped to HTTP status codes and OpenAI error bodies in one place."""

from __future__ import annotations


class ConduitError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ConduitError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ConduitError):
    """A missing or wrong API key (`--api-key`)."""

    status = 401
    type = "invalid_request_error"


class NotFound(ConduitError):
    status = 404
    type = "not_found_error"


class Overloaded(ConduitError):
    """Too many queued requests (429) or the engine cannot take work now (503); clients should retry."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, status: int = 429, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after
        self.status = status


class EngineFailed(ConduitError):
    status = 500
    type = "server_error"


class StepFailed(ConduitError):
    """A step could not run for a reason outside the device (an Engram shard crashed): the step's
    requests fail with a 503 (retry), and the engine keeps serving."""

    status = 503
    type = "server_error"


class BadGateway(ConduitError):
    """The gateway's worker could not answer: unreachable, or lost mid-answer (`code` says which)."""

    status = 502
    type = "server_error"


def error_from_status(
    status: int, message: str, *, type: str | None = None, param: str | None = None, code: str | None = None
) -> ConduitError:
    """Rebuild the exception for a `RequestFailed` message that crossed the mailbox."""
    cls = {400: InvalidRequest, 404: NotFound, 429: Overloaded, 503: Overloaded}.get(status, EngineFailed)
    err = (
        cls(message, param=param, code=code)
        if cls is not Overloaded
        else cls(message, status=status, param=param, code=code)
    )
    if type:
        err.type = type
    if cls is EngineFailed and status >= 500:  # 502 / 504 of a failed KV transfer keep their status
        err.status = status
    return err
