"""A tiny Idefics3 (SmolVLM's architecture) built locally with random weights.

The Mage-VL stage's image path is proven on it: vLLM and transformers support
Idefics3 without remote code, and its image processor has a Pillow backend,
so neither needs torchvision (the CPU venv has none that matches its torch;
Qwen2-VL, LLaVA and Gemma 3 import torchvision in vLLM or transformers).

The language model is the tiny Qwen2-shaped model's tokenizer and sizes
(``build_tiny_model``, heads 64 wide as vLLM's CPU attention needs) as a
Llama; the vision tower is one SigLIP-style layer over 56-pixel tiles of
14-pixel patches, and the connector shuffles 2x2 patches into one token:
``IMAGE_SEQ_LEN`` = (56 / 14)^2 / 2^2 = 4 tokens per tile. Images are resized
so their longest edge is ``LONGEST_EDGE`` and split into 56-pixel tiles
(``idefics3_image_tokens`` states the rule).
"""

from __future__ import annotations

import math
from pathlib import Path

from workers.backends.tiny_model import HEADS, HIDDEN, build_tiny_model

TILE = 56
PATCH = 14
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
LONGEST_EDGE = 2 * TILE
IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")
READY = "READY-vlm"


def idefics3_image_tokens(width: int, height: int) -> int:
    """The ``<image>`` tokens one image becomes, by Idefics3's rule.

    The longest edge is scaled to ``LONGEST_EDGE`` (the other keeps the
    aspect ratio, truncated, then rounded up to even), each edge is rounded
    up to whole tiles; an image of more than one tile is ``rows x cols``
    tiles plus one global view, each ``IMAGE_SEQ_LEN`` tokens; one tile is
    the global view alone.
    """
    if width >= height:
        w, h = LONGEST_EDGE, int(LONGEST_EDGE / (width / height))
        h += h % 2
    else:
        h, w = LONGEST_EDGE, int(LONGEST_EDGE * (width / height))
        w += w % 2
    rows, cols = math.ceil(h / TILE), math.ceil(w / TILE)
    views = 1 if rows * cols == 1 else rows * cols + 1
    return views * IMAGE_SEQ_LEN


def build_tiny_vlm(path: str | Path) -> Path:
    """Write the tiny Idefics3 model, tokenizer and processor into ``path`` (reused)."""
    import torch
    import transformers as tf
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    path = Path(path)
    if (path / READY).exists():
        return path
    text_dir = build_tiny_model(path / "text", extra_special_tokens=IMAGE_TOKENS)
    tokenizer = tf.AutoTokenizer.from_pretrained(text_dir)
    text_config = tf.LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    vision_config = tf.Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        image_size=TILE,
        patch_size=PATCH,
    )
    config = tf.Idefics3Config(
        vision_config=vision_config.to_dict(),
        text_config=text_config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.Idefics3ForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=True,
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE},
    )
    processor = tf.Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(path)
    (path / READY).write_text("ok\n")
    return path
