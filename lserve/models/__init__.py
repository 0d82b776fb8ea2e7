"""Weight loading and the Llama-family forward."""

from lserve.models.llama import LlamaModel
from lserve.models.loader import LoadedModel, load_model

__all__ = ["LlamaModel", "LoadedModel", "load_model"]
