"""OpenAI's error body for every error, ours or the framework's: `{"error": {"message", "type", "param", "code"}}`.

400 for any bad input (malformed JSON, wrong types, missing or out-of-range fields, unsupported parameters), 401
for a missing or wrong API key, 404 for an unknown model or route, 405 for a wrong method, 429 (with Retry-After)
when the queue is full, 503 while shutting down or for a request that waited past --queue-timeout (with
Retry-After), 504 for one that made no progress for --stall-timeout or ran past its total deadline (--request-timeout
or its `timeout` field); those are cancelled, and the message names the bound.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import UNSUPPORTED, ErrorResponse

log = logging.getLogger("specdecode.server")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ensure_ascii: a message may quote user input, which may hold lone surrogates that UTF-8 cannot encode
        return Response(json.dumps(self.body(), ensure_ascii=True), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class ClientGone(Exception):
    """The client disconnected while its request was waiting: nobody reads the answer."""


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the error names the field in `param`)."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
    429: {"model": ErrorResponse, "description": "Queue full; retry after the Retry-After header's seconds."},
    503: {"model": ErrorResponse, "description": "Shutting down, or the request waited in the queue past "
                                                  "--queue-timeout (retry after the Retry-After header's seconds)."},
    504: {"model": ErrorResponse, "description": "The request made no progress for --stall-timeout, or ran past its "
                                                  "total deadline (--request-timeout or its timeout field), and was "
                                                  "cancelled."},
}


def error_param(loc: Sequence) -> str | None:
    """A validation error's location as a field path: ("body", "messages", 0, "content") -> messages[0].content.

    pydantic adds the member of a union it tried (str, list[str], ...) to the location: those are left out.
    """
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        item = str(item)
        if not item.isidentifier() or item in ("str", "int", "float", "bool", "list", "dict", "none"):
            continue
        parts.append(item)
    return ".".join(parts) or None


def _top_field(param: str | None) -> str | None:
    return param.split(".")[0].split("[")[0] if param else None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a failed validation as a 400, naming every unsupported parameter that was sent."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    params = [error_param(e.get("loc", ())) for e in errors]
    unsupported = list(dict.fromkeys(f for f in map(_top_field, params) if f in UNSUPPORTED))
    if unsupported:
        return _unsupported(unsupported)
    param = params[0]
    if param is None:
        if first.get("type") == "missing":
            return bad_request("a JSON object body is required", code="missing_body")
        return bad_request("the request body must be a JSON object", code="invalid_body")
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if first.get("type") == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    others = set(params[1:]) - {param}
    more = f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})" if others else ""
    return bad_request(f"{param}: {message}{more}", param)


def _unsupported(names: list[str]) -> APIError:
    listed = ", ".join(names)
    neutral = "; ".join(f"{name}: {UNSUPPORTED[name]}" for name in names)
    verb = "is" if len(names) == 1 else "are"
    return bad_request(f"{listed} {verb} not supported by this server: leave {'it' if len(names) == 1 else 'them'} "
                       f"out or send the neutral value ({neutral})",
                       names[0], "unsupported_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _gone(_request, _exc: ClientGone):
        return Response(status_code=499)  # nginx's code, for the logs and metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, message, kind, None, None, dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error", None,
                        "internal_error").response()
