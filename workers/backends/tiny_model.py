"""A tiny chat model built locally: no downloads.

Used by the tests, and by a ``vllm`` stage as its fallback when the configured
model cannot be found or fetched (``fallback_model_dir``), so the default
pipeline still runs on a machine without network.

``build_tiny_model(path)`` writes a Hugging Face model directory that vLLM
loads like any other: a byte-level BPE tokenizer trained on the small corpus
below (with ChatML special tokens and chat template), and a two-layer
Qwen2-architecture model with random weights. Attention heads are 64 wide:
vLLM's CPU attention rejects narrower heads (16 fails).

The weights are random, so the text is gibberish, but it is deterministic
(fixed seed, greedy sampling) and real: every token comes out of the engine.
The output rows of the special tokens, and of every token that is not
printable ASCII, are zeroed: greedy decoding then never ends a response early,
never produces a token that detokenizes to nothing, and its text round-trips
through the tokenizer.

``extra_special_tokens`` adds special tokens after training (so the BPE
vocabulary and every existing id stay as they are), e.g. MiniCPM-o's
``<|listen|>``, ``<|speak|>`` and ``<unk>`` placeholder. Like the built-in
special tokens, their output rows are zeroed: greedy decoding never picks
one unless the request forces it (``allowed_token_ids``, a logit bias).

Building takes about a second; a directory already built (marked by
``READY``) with the same extra tokens is reused.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ 'You may call these functions:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool['function'] | tojson + '\n' }}{% endfor %}"
    '{{ \'</tools>\nCall one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>\''
    " + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>' + message['content']"
    " + '</tool_response><|im_end|>\n' }}"
    "{% elif message.get('tool_calls') %}{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name']"
    " + '\", \"arguments\": ' + call['function']['arguments'] + '}</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, with tools as Qwen2.5's template renders them (the Hermes call format, which
vLLM's ``hermes`` tool parser reads)."""
TEMPLATE_VERSION = 2
"""Bumped when the template changes: a directory built with an older one is rebuilt."""

CORPUS = [
    "hello there, how are you doing today?",
    "the quick brown fox jumps over the lazy dog.",
    "a full duplex model listens while it speaks and stops when interrupted.",
    "stream the tokens to the client as soon as they are ready.",
    "the weather is sunny with a light breeze from the west.",
    "tell me a story about a robot who learned to paint.",
    "numbers: one two three four five six seven eight nine ten.",
    "What is the capital of France? Paris is the capital of France.",
    "Please summarise the meeting notes in three short points.",
    "I would like a cup of tea and a slice of lemon cake.",
]

HIDDEN = 128
HEADS = 2
"""head_dim = HIDDEN // HEADS = 64."""
MAX_POSITIONS = 1024
READY = "READY"


def build_tiny_model(path: str | Path, *, extra_special_tokens: Sequence[str] = ()) -> Path:
    """Write the tiny tokenizer and model into ``path`` (reused when already built).

    ``extra_special_tokens`` are added to the tokenizer as special tokens
    (see the module docstring); without them the model is the same as ever.
    """
    path = Path(path)
    extras = tuple(extra_special_tokens)
    overlap = set(extras) & set(SPECIAL_TOKENS)
    if overlap or len(set(extras)) != len(extras):
        raise ValueError(f"extra special tokens must be new and distinct, got {extras}")
    marker = (
        f"ok v{TEMPLATE_VERSION}\n"
        if not extras
        else f"ok v{TEMPLATE_VERSION} {json.dumps(list(extras))}\n"
    )
    ready = path / READY
    if ready.exists() and ready.read_text() == marker:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(extras)
    tokenizer.save_pretrained(path)
    _build_model(path, tokenizer, extras)
    ready.write_text(marker)
    return path


def _build_tokenizer(extras: tuple[str, ...] = ()) -> Any:
    # Imported by name: neither library is typed, and only builders use them.
    tk: Any = importlib.import_module("tokenizers")
    tf: Any = importlib.import_module("transformers")
    Tokenizer, decoders, models = tk.Tokenizer, tk.decoders, tk.models
    pre_tokenizers, trainers = tk.pre_tokenizers, tk.trainers
    PreTrainedTokenizerFast = tf.PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        # Extras come after the trained vocabulary: existing ids do not move.
        additional_special_tokens=["<|im_start|>", *extras],
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(path: Path, tokenizer: Any, extras: tuple[str, ...] = ()) -> None:
    torch: Any = importlib.import_module("torch")
    tf: Any = importlib.import_module("transformers")
    GenerationConfig, Qwen2Config, Qwen2ForCausalLM = (
        tf.GenerationConfig,
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
    )

    vocab = -(-len(tokenizer) // 64) * 64
    special = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    silent = set(special) | {tokenizer.convert_tokens_to_ids(token) for token in extras}
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=special[1],
        eos_token_id=special[2],
        pad_token_id=special[0],
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        head = model.lm_head.weight
        head.normal_(0.0, 0.5)
        # No special token and no padding row ever wins a greedy step.
        head[len(tokenizer) :] = 0.0
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if token_id in silent or not (text.isascii() and text.isprintable()):
                head[token_id] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=special[2], pad_token_id=special[0]).save_pretrained(path)
    (path / "duplexq_tiny.json").write_text(json.dumps({"vocab": vocab, "special": special}))
