"""The server's errors as OpenAI answers them: ``APIError`` (a refusal with its status), the
engine's errors mapped to a status (4xx for the client's fault, 5xx for ours, 503 while the
engine restarts), and the JSON body every error has.

Which requests are refused is decided elsewhere (``translate``, the routes, the middleware);
this module only says how a refusal looks on the wire.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from guidespec.llm import EngineDeadError, RequestError

RETRY_AFTER_S = 5  # what a 503 tells clients to wait (an engine restart takes a few seconds)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def status_of(e: Exception) -> int:
    """The HTTP status of an engine's error: 503 for a dead or restarting engine, else its own."""
    if isinstance(e, EngineDeadError):
        return 503
    return e.status if isinstance(e, RequestError) else 500


def code_of(e: Exception) -> str:
    """An engine error's own kind (``"grammar_failed"``), or ""."""
    return e.code if isinstance(e, RequestError) else ""


def engine_message(e: Exception) -> str:
    """The engine's refusal without our request id prefix."""
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith("request ") and ": " in text else text


def refused(e: RequestError | EngineDeadError) -> APIError:
    """An engine's refusal (or its death) before the answer began, as the answer to give."""
    return APIError(status_of(e), engine_message(e), code=code_of(e))


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, param: str | None = None, code: str = "") -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "APIError"),
                "param": param,
                "code": code or status,
            }
        },
        status_code=status,
        headers=headers,
    )
