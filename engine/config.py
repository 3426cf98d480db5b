"""Typed configuration: the model's shape (read from config.json or GGUF metadata) and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from connector import ConnectorConfig
from engine.agent_config import AgentConfig

# HF architecture name -> (model family, q/k/v carry a bias, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
# GGUF ``general.architecture`` -> HF architecture name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder; everything the model and the KV cache need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; supported: {sorted(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPES)}")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From a config.json dict; accepts both pre-5 and transformers-5 key spellings."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
        _, bias, qk_norm = ARCHITECTURES[arch]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            dtype=dtype if dtype in DTYPES else "float32",
            eos_token_ids=[] if eos is None else list(eos) if isinstance(eos, list) else [eos],
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_gguf(cls, meta: dict, has_output_weight: bool) -> "ModelConfig":
        """From GGUF metadata (``{arch}.block_count`` etc.); GGUF weights are dequantised to float32."""
        arch_name = meta.get("general.architecture")
        if arch_name not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        arch = GGUF_ARCHITECTURES[arch_name]
        _, bias, qk_norm = ARCHITECTURES[arch]

        def get(key, default=None):
            value = meta.get(f"{arch_name}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
            return value

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = meta.get(f"{arch_name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise ValueError(f"GGUF metadata lacks {arch_name}.vocab_size and tokenizer.ggml.tokens")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=get("attention.key_length", hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings=not has_output_weight,
            qkv_bias=bias,
            qk_norm=qk_norm,
            eos_token_ids=[] if eos is None else [eos],
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        )


@dataclass
class EngineConfig:
    """Engine knobs. ``num_blocks`` of ``block_size`` tokens form the paged KV cache."""

    block_size: int = 16
    num_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    dtype: str | None = None
    device: str = "cpu"
    # torch CPU threads (for the whole process); None: the engine's default, one less than the
    # cores this process may use (engine/threads.py), unless the program or OMP_NUM_THREADS set it.
    threads: int | None = None
    admission_watermark: float = 0.01
    # Load and save KV through a store (docs/connector.md); None = the local prefix cache only.
    connector: ConnectorConfig | None = None
    # Agent sessions across tool calls (engine/sessions.py, docs/agents.md).
    agents: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPES)}")
        if self.connector is not None:
            self.connector.check_block_size(self.block_size)
