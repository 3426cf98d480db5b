"""Text <-> token ids via the ``tokenizers`` library, plus the model's chat template.

An HF folder ships ``tokenizer.json`` (and ``tokenizer_config.json`` with the chat template).
A GGUF file carries its vocabulary in metadata; transformers converts it once and we cache
the result as ``<model>.tokenizer.json`` beside the file (or in memory if that is read-only).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_path(cls, model_path: Path) -> "Tokenizer":
        if model_path.is_dir():
            return cls.from_hf_folder(model_path)
        return cls.from_gguf(model_path)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "Tokenizer":
        tok_file = folder / "tokenizer.json"
        if not tok_file.exists():
            raise ValueError(f"{folder} has no tokenizer.json")
        config = {}
        if (folder / "tokenizer_config.json").exists():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(HFTokenizer.from_file(str(tok_file)), template,
                   _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    @classmethod
    def from_gguf(cls, gguf_file: Path) -> "Tokenizer":
        cached = gguf_file.with_name(gguf_file.name + ".tokenizer.json")
        meta_file = gguf_file.with_name(gguf_file.name + ".tokenizer_config.json")
        if cached.exists() and meta_file.exists():
            meta = json.loads(meta_file.read_text())
            return cls(HFTokenizer.from_file(str(cached)), meta.get("chat_template"),
                       meta.get("bos_token"), meta.get("eos_token"))
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        meta = {"chat_template": getattr(hf, "chat_template", None),
                "bos_token": hf.bos_token, "eos_token": hf.eos_token}
        try:
            hf.backend_tokenizer.save(str(cached))
            meta_file.write_text(json.dumps(meta))
        except OSError:
            pass
        return cls(hf.backend_tokenizer, meta["chat_template"], meta["bos_token"], meta["eos_token"])

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's Jinja template."""
        if not self.chat_template:
            raise ValueError("this model ships no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token
