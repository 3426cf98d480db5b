"""The bundled paged-attention engine for Llama-family models.

``LLM(model_path).generate(prompts, SamplingParams(...))``; see ``engine.llm`` for the step
loop and ``engine.attention`` for the KV cache layout.
"""

from engine import threads
from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM, RequestOutput
from engine.sampling import SamplingParams

threads.set_default()  # here, so that a program's own torch.set_num_threads, made later, wins

__all__ = ["LLM", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
