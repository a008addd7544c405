"""The OpenAI-compatible HTTP server: `create_app(generator, model_name, tokenizer, settings)` builds the FastAPI
app; `specdecode serve` runs it with uvicorn. The engine never imports this package."""

from .app import APIError, ServerSettings, create_app
from .batcher import Batcher, Job

__all__ = ["create_app", "ServerSettings", "APIError", "Batcher", "Job"]
