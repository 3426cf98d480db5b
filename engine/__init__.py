"""The bundled paged-attention engine for Llama-family models."""
