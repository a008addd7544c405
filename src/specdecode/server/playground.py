"""The playground: a page at `/` that streams a completion with each token coloured by where it came from
(accepted draft, resampled, bonus, plain target), live speculative counters, and a race of plain against
speculative decoding. Plain HTML/CSS/JS shipped in the package (static/), no build step and nothing fetched from
elsewhere; the page talks to the server only through the documented API (/v1/completions or /v1/chat/completions
with stream=true and the "specdecode" provenance extension, /v1/models, /health, /openapi.json)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from .errors import APIError

STATIC_TYPES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
                "playground.css": "text/css; charset=utf-8"}

router = APIRouter(include_in_schema=False)


def _static(name: str) -> Response:
    # Only the page's own files are served: a fixed list, so no path from a request ever reaches the filesystem.
    if name not in STATIC_TYPES:
        raise APIError(404, f"no static file {name!r}: the playground has {', '.join(STATIC_TYPES)}",
                       "not_found_error", None, "not_found")
    content = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(content, media_type=STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})


@router.get("/")
async def page() -> Response:
    return _static("index.html")


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    return _static(name)
