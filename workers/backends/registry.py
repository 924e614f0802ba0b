"""Backend construction by the name a pipeline config gives.

Only the built-in names below can be created; nothing named in a config is
imported dynamically. Backends with heavy dependencies (vLLM) are imported
when a stage asks for them, so a worker of another stage does not need them.
"""

from __future__ import annotations

from schemas.config import StageConfig
from workers.backends.base import StageBackend
from workers.backends.echo import EchoBackend


def create_backend(stage: StageConfig) -> StageBackend:
    if stage.backend == "echo":
        return EchoBackend(stage.options)
    if stage.backend == "vllm":
        from workers.backends.vllm_backend import VllmBackend

        return VllmBackend(stage.options, stage=stage.name)
    if stage.backend == "minicpmo":
        from workers.backends.minicpmo_stage import MiniCPMOStage

        return MiniCPMOStage(stage.options, stage=stage.name)
    if stage.backend == "mage_vl":
        from workers.backends.mage_vl_stage import MageVLStage

        return MageVLStage(stage.options, stage=stage.name)
    if stage.backend == "vad":
        from workers.backends.vad import VadBackend

        return VadBackend(stage.options)
    if stage.backend == "asr":
        from workers.backends.asr import AsrBackend

        return AsrBackend(stage.options)
    if stage.backend == "tts":
        from workers.backends.tts import TtsBackend

        return TtsBackend(stage.options)
    raise ValueError(f"stage {stage.name!r}: backend {stage.backend!r} is not available yet")
