"""The OpenAI error object every non-2xx answer carries: raised wherever a request is refused
(the ingress or the replica; it pickles whole, so it crosses the handle) and answered as JSON at
the ingress."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RETRY_AFTER_S = 1  # what a 503 tells clients to wait: a queue slot frees within a few steps


class APIError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with a status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )
        self.headers = headers  # e.g. Retry-After on 503

    def __reduce__(self) -> tuple[Any, ...]:
        return APIError, (self.message, self.status, self.type, self.param, self.code, self.headers)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# What a transport's failure is as an answer: the Serve layer's names Ray's errors
# (deployments/serve/handle_replica.py), so the frontend never imports Ray to read them.
ErrorOf = Callable[[BaseException], APIError]
