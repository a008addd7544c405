"""Model loading: built-in models shipped on PyPI, local HF directories, GGUF files."""

from .loading import DeviceUnavailableError, LoadedModel, ModelNotFoundError, load_model

__all__ = ["LoadedModel", "ModelNotFoundError", "DeviceUnavailableError", "load_model"]
