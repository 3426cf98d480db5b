"""Model definitions (Llama family) and their checkpoint loader."""

from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model

__all__ = ["LlamaForCausalLM", "load_model"]
