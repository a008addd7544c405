from .base import Drafter
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "ModelDrafter", "PromptLookupDrafter"]
