from .base import Drafter
from .model import ModelDrafter

__all__ = ["Drafter", "ModelDrafter"]
