"""The tiny local chat model the model tests use; it lives in the product, where a
``vllm`` stage also builds it as its offline fallback."""

from workers.backends.tiny_model import (
    CHAT_TEMPLATE,
    CORPUS,
    SPECIAL_TOKENS,
    build_tiny_model,
)

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SPECIAL_TOKENS", "build_tiny_model"]
