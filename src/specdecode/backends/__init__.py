from .base import ModelBackend
from .hf import HFBackend

__all__ = ["ModelBackend", "HFBackend"]
