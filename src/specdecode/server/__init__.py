"""The OpenAI-compatible HTTP server: `create_app(generator, model_name, tokenizer, settings)` builds the FastAPI
app; `run(app, host, port)` serves it with uvicorn (what `specdecode serve` does). The engine never imports this
package."""

from .app import create_app
from .batcher import Batcher, Job
from .errors import APIError
from .run import run
from .settings import ServerSettings, served_names

__all__ = ["create_app", "run", "ServerSettings", "served_names", "APIError", "Batcher", "Job"]
