"""ASGI middleware: the API key check, and one metrics update and one log line per HTTP request."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from .errors import APIError
from .metrics import ServerMetrics

log = logging.getLogger("specdecode.server")

PUBLIC_PATHS = {"/health"}
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/predict",
             "/openapi.json", "/docs", "/redoc"}
QUIET_PATHS = {"/health", "/metrics"}  # polled by load balancers and Prometheus: logged at debug level only


class AuthMiddleware:
    """With an API key, every path but /health and the playground page needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        # The playground page itself is public (a browser cannot send the bearer header to open it); its API
        # calls carry the key like any client's.
        if scope["type"] != "http" or path in PUBLIC_PATHS or path == "/" or path.startswith("/static/"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given else
                       "invalid API key")
            response = APIError(401, message, "authentication_error", None, "invalid_api_key",
                                {"WWW-Authenticate": "Bearer"}).response()
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and status code, times it to the end of its response, and logs it."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models/{model}" if path.startswith("/v1/models/") \
            else "other"
        status = {"code": 500}
        start = time.perf_counter()

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            status["code"] = 499  # the client went away (nginx's code)
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
            self.metrics.request_latency.labels(endpoint=endpoint).observe(elapsed)
            client = scope.get("client")
            log.log(logging.DEBUG if path in QUIET_PATHS else logging.INFO, "%s %s %s %d in %.3f s",
                    f"{client[0]}:{client[1]}" if client else "-", scope["method"], ascii(path)[1:-1],
                    status["code"], elapsed)
