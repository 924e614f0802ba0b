"""Options of a ``vllm`` stage (``StageConfig.options``), validated when the backend is built.

Engine options (``model`` .. ``seed``) configure the one engine a worker
process runs; sampling and history options apply per response. Unknown keys
are refused so that a typo does not silently fall back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class VllmOptions(BaseModel):
    """What a ``vllm`` stage's ``options`` table may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: str = Field(min_length=1)
    """Model directory or Hugging Face id (workers have no network: use a local path)."""
    tokenizer: str | None = None
    """Tokenizer directory or id when it differs from ``model``; needs a chat template."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weight and activation dtype."""
    max_model_len: int = Field(4096, ge=32, le=1_048_576)
    """Context length of one request: prompt plus generated tokens."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of accelerator memory the engine may take. On the CPU build it is the
    fraction of system memory, and is ignored when ``kv_cache_memory_bytes`` is set."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1 << 20)
    """Explicit KV cache size in bytes (on CPU this also skips the start-up profiling run)."""
    enforce_eager: bool = False
    """Run the model eagerly: no graph capture or compilation (faster start, slower steps)."""
    seed: int | None = Field(None, ge=0)
    """Engine seed, and every request's sampling seed: responses are reproducible. Unset,
    each request draws its own from its id (``vllm_engine.request_seed``)."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens one response generates."""
    temperature: float = Field(0.7, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    system_prompt: str | None = None
    """System message placed before the conversation; always kept."""
    history_max_messages: int = Field(32, ge=2, le=10_000)
    """Most user/assistant messages kept in a session's history (oldest dropped first)."""
    history_max_tokens: int | None = Field(None, ge=16)
    """Token budget of a prompt; default ``max_model_len - max_tokens``."""
    tool_parser: str = Field("hermes", pattern=r"^[a-z0-9_]{1,40}$")
    """vLLM's tool-call parser for the model family (``hermes``: Qwen2.5, Hermes, the
    tiny test model, and any model prompted through duplexq's Hermes-format tool
    note); see ``vllm_tools``."""
    fallback_model_dir: str | None = None
    """Where to build a tiny local model when ``model`` is neither local, cached nor
    downloadable (logged as a warning); unset: such a model is an error."""

    @model_validator(mode="after")
    def _check_budget(self) -> Self:
        if self.max_tokens >= self.max_model_len:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be below max_model_len ({self.max_model_len})"
            )
        if self.history_max_tokens is not None and (
            self.history_max_tokens + self.max_tokens > self.max_model_len
        ):
            raise ValueError(
                f"history_max_tokens + max_tokens ({self.history_max_tokens} + "
                f"{self.max_tokens}) must not exceed max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def prompt_budget(self) -> int:
        """Most prompt tokens one request may carry."""
        if self.history_max_tokens is not None:
            return self.history_max_tokens
        return self.max_model_len - self.max_tokens

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": True,
        }
        if self.tokenizer is not None:
            kwargs["tokenizer"] = self.tokenizer
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.seed is not None:
            kwargs["seed"] = self.seed
        # Forced function calls generate compact JSON (no whitespace to wander in).
        kwargs["structured_outputs_config"] = {"backend": "xgrammar",
                                               "disable_any_whitespace": True}  # fmt: skip
        return kwargs


class MultimodalVllmOptions(VllmOptions):
    """``VllmOptions`` plus what a multimodal checkpoint (Mage-VL, MiniCPM-o, ...) may
    need from the engine."""

    trust_remote_code: bool = False
    """Let vLLM run the checkpoint's own config and processor code (MiniCPM-o, Mage-VL,
    MiniCPM-V and other checkpoints that transformers does not ship need it)."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """vLLM's per-prompt item limits by modality, e.g. ``{audio = 64, image = 16}``: a
    prompt holds every frame or unit it describes, so the limits must cover them."""

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs = super().engine_kwargs()
        if self.trust_remote_code:
            kwargs["trust_remote_code"] = True
        if self.limit_mm_per_prompt is not None:
            kwargs["limit_mm_per_prompt"] = dict(self.limit_mm_per_prompt)
        return kwargs


def parse_options(stage: str, options: Mapping[str, Any]) -> VllmOptions:
    """Validate a stage's options; raises ValueError naming the stage and each bad field."""
    try:
        return VllmOptions.model_validate(dict(options))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'options'}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"vllm stage {stage!r}: bad options: {problems}") from exc
