"""Model extensions: the model-specific, pure part of a ``vllm`` stage.

``base`` holds the contract (``ModelExtension``, ``AppendPlan``, ``Decision``,
``load_extension``); ``budget`` the MiniCPM-o token-budget arithmetic;
``minicpmo`` the MiniCPM-o 4.5 duplex extension. Nothing here does I/O or
imports vLLM, so the whole package is tested without a GPU.
"""

from workers.extensions.base import (
    AppendPlan,
    CheckedExtension,
    Decision,
    DecisionAction,
    ModelExtension,
    RequestBuffer,
    StageSamplingParams,
    builtin_extensions,
    copy_sampling_params,
    load_extension,
)

__all__ = [
    "AppendPlan",
    "CheckedExtension",
    "Decision",
    "DecisionAction",
    "ModelExtension",
    "RequestBuffer",
    "StageSamplingParams",
    "builtin_extensions",
    "copy_sampling_params",
    "load_extension",
]
