"""Backend construction by the name a pipeline config gives.

Only the built-in names below can be created; nothing named in a config is
imported dynamically.
"""

from __future__ import annotations

from schemas.config import StageConfig
from workers.backends.base import StageBackend
from workers.backends.echo import EchoBackend


def create_backend(stage: StageConfig) -> StageBackend:
    if stage.backend == "echo":
        return EchoBackend(stage.options)
    raise ValueError(f"stage {stage.name!r}: backend {stage.backend!r} is not available yet")
