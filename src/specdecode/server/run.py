"""Serving an app with uvicorn (what `specdecode serve` does): uvicorn's log lines and ours through `logging` in one
format, one line per event; a startup line with the address; "server stopped" at the end, whether the server was
stopped with Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import logging.config
import signal
import threading

from ..errors import OptionError

log = logging.getLogger("specdecode.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"


def log_config(level: str = "info") -> dict:
    """A logging.config dict: uvicorn's loggers and specdecode's write one line per event to stderr."""
    from uvicorn.config import LOG_LEVELS

    if level not in LOG_LEVELS:
        raise OptionError("log_level", f"log_level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": LOG_FORMAT, "datefmt": "%Y-%m-%d %H:%M:%S"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "line", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": LOG_LEVELS[level], "propagate": False},
            "uvicorn.error": {"level": LOG_LEVELS[level], "propagate": True},
            "uvicorn.access": {"level": LOG_LEVELS[level], "propagate": True},
            "specdecode": {"handlers": ["stderr"], "level": LOG_LEVELS[level], "propagate": False},
        },
    }


class _Stopped(Exception):
    """SIGTERM, re-raised by uvicorn once its graceful shutdown is over."""


def _on_sigterm(_signum, _frame):
    raise _Stopped()


def run(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        graceful_shutdown_s: float | None = None) -> None:
    """Serve an app made by create_app until Ctrl-C or SIGTERM; in-flight requests get graceful_shutdown_s
    (default: the app's settings.shutdown_grace_s).

    On a signal uvicorn stops accepting, lets in-flight requests finish, the app's shutdown stops the engine
    worker, and this function returns (uvicorn re-raises the signal afterwards: it is caught here).
    """
    import uvicorn

    config = log_config(log_level)
    logging.config.dictConfig(config)
    served = app.state.served
    if graceful_shutdown_s is None:
        graceful_shutdown_s = app.state.settings.shutdown_grace_s
    if host not in LOOPBACK and not app.state.settings.api_key:
        log.warning("binding %s without an API key: anyone who can reach port %d can use the model", host, port)
    mode = (f"speculative decoding, k={served.num_speculative_tokens}, draft {served.draft_name!r}"
            if served.has_draft else "plain decoding")
    address = f"[{host}]" if ":" in host else host
    log.info("serving %s (%s) at http://%s:%d/v1", ", ".join(map(repr, served.names)), mode, address, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=config, log_level=log_level,
                                           access_log=False, timeout_graceful_shutdown=graceful_shutdown_s))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    log.info("server stopped")
