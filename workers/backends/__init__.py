"""Stage backends: what a stage does with a session's events."""

from workers.backends.base import BackendError, OutputDraft, StageBackend, StageContext
from workers.backends.registry import create_backend

__all__ = ["BackendError", "OutputDraft", "StageBackend", "StageContext", "create_backend"]
