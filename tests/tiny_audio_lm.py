"""A tiny Qwen2-Audio built locally with random weights, whose audio token is ``<unk>``.

The MiniCPM-o stage's audio path is proven on it: vLLM and transformers
support Qwen2-Audio without remote code, and its feature extractor is
Whisper's (numpy only). Its audio token is ``<unk>``, the placeholder the
MiniCPM-o extension fills a unit's budget with, so the stage's prompt goes
to the engine as it goes to a real MiniCPM-o. The tokenizer is the tiny
model's with MiniCPM-o's ``<|listen|>`` and ``<|speak|>`` (the stage
resolves them) and Qwen2-Audio's boundary tokens; heads are 64 wide.

Qwen2-Audio's rule (``qwen2_audio_tokens``): Whisper features at 100 per
second (a 160-sample hop), halved by the encoder's strided convolution, then
pooled by 2. MiniCPM-o's budget charges 12 tokens per whole second, so the
two agree only for some lengths (16 tokens for 0.64 s), which is what the
test uses to show vLLM holds the stage's placeholders to the model's count.
"""

from __future__ import annotations

from pathlib import Path

from workers.backends.tiny_model import build_tiny_model

AUDIO_TOKENS = ("<|listen|>", "<|speak|>", "<unk>", "<|audio_bos|>", "<|audio_eos|>")
HOP = 160
MEL_BINS = 128
READY = "READY-audio"


def qwen2_audio_tokens(samples: int) -> int:
    """Audio tokens Qwen2-Audio gives ``samples`` 16 kHz samples (module docstring)."""
    frames = samples // HOP
    convolved = (frames - 1) // 2 + 1
    return (convolved - 2) // 2 + 1


def build_tiny_audio_lm(path: str | Path) -> Path:
    """Write the tiny Qwen2-Audio model, tokenizer and processor into ``path`` (reused)."""
    import torch
    import transformers as tf

    path = Path(path)
    if (path / READY).exists():
        return path
    text_dir = build_tiny_model(path / "text", extra_special_tokens=AUDIO_TOKENS)
    tokenizer = tf.AutoTokenizer.from_pretrained(text_dir)
    text_config = tf.Qwen2Config.from_pretrained(text_dir)
    audio_config = tf.Qwen2AudioEncoderConfig(
        num_mel_bins=MEL_BINS,
        d_model=64,
        encoder_layers=1,
        encoder_attention_heads=1,
        encoder_ffn_dim=128,
        max_source_positions=1500,
    )
    config = tf.Qwen2AudioConfig(
        audio_config=audio_config.to_dict(),
        text_config=text_config.to_dict(),
        audio_token_index=tokenizer.convert_tokens_to_ids("<unk>"),
    )
    torch.manual_seed(0)
    model = tf.Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():
        # As in the tiny text model: greedy decoding never picks a special token
        # (an answer holding the audio token would read as one more audio).
        head = model.get_output_embeddings().weight
        head[len(tokenizer) :] = 0.0
        head[tokenizer.all_special_ids] = 0.0
        head[tokenizer.convert_tokens_to_ids(list(AUDIO_TOKENS))] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    _flatten_language_model_keys(path / "model.safetensors")
    tokenizer.save_pretrained(path)
    processor = tf.Qwen2AudioProcessor(
        feature_extractor=tf.WhisperFeatureExtractor(feature_size=MEL_BINS),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        audio_token="<unk>",
    )
    processor.save_pretrained(path)
    (path / READY).write_text("ok\n")
    return path


def _flatten_language_model_keys(weights: Path) -> None:
    """Rename ``language_model.model.model.*`` to ``language_model.model.*``.

    transformers 5.19 saves Qwen2-Audio's language model one ``model.`` level
    deeper than the checkpoints on the Hub (and vLLM's loader) name it.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    prefix, flat = "language_model.model.model.", "language_model.model."
    renamed = {
        (flat + key[len(prefix) :] if key.startswith(prefix) else key): tensor
        for key, tensor in tensors.items()
    }
    save_file(renamed, weights, metadata={"format": "pt"})
