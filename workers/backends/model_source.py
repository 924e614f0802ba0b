"""Where a model stage's weights come from: a local directory, the Hugging Face
cache, a download where the network allows, or (if configured) a tiny model
built locally.

Resolution order for ``model``:

1. ``package:NAME``: a model shipped in a Python package, prepared once in the
   models directory (``workers.backends.packaged_model``); the default
   pipeline's thinker is one;
2. an existing local directory: used as is;
3. a Hugging Face id already in the local cache: the cached snapshot;
4. a download, unless ``HF_HUB_OFFLINE`` is set;
5. with ``fallback_dir`` set (relative paths are under the models directory):
   the tiny random-weight chat model of ``workers.backends.tiny_model``, built
   there once. It is a last resort and loud on purpose: a WARNING says the
   configured model was not available and that answers come from random
   weights, and the worker reports it (``up`` prints it, the demo page shows it).

Without a fallback, a model that cannot be found is an error naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from workers.backends.packaged_model import (
    PreparationFailed,
    models_dir,
    packaged_name,
    prepare,
)
from workers.backends.tiny_model import build_tiny_model

log = logging.getLogger("duplexq.worker.model")


class ModelUnavailable(RuntimeError):
    """The configured model is neither local, cached nor downloadable."""


def _from_hub(model: str) -> str | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return str(snapshot_download(model, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return None
    try:
        return str(snapshot_download(model))
    except Exception as exc:
        log.info("could not download %s: %s", model, exc)
        return None


def resolve_model(model: str, fallback_dir: str | None = None) -> tuple[str, bool]:
    """``(path or id to load, whether it is the tiny fallback)``."""
    found: str | None = None
    packaged = packaged_name(model)
    if packaged is not None:
        try:
            found = str(prepare(packaged))
        except PreparationFailed as exc:
            log.warning("packaged model %s: %s", packaged, exc)
    elif Path(model).is_dir():
        return model, False
    else:
        found = _from_hub(model)
    if found is not None:
        return found, False
    if fallback_dir is None:
        raise ModelUnavailable(
            f"model {model!r} is not a local directory, not in the Hugging Face cache, "
            "and could not be downloaded or prepared"
        )
    path = build_tiny_model(str(models_dir() / fallback_dir))
    log.warning(
        "model %s is not available on this machine (no local copy, no cache, no network): "
        "serving the locally built TINY model at %s instead. Its weights are random: "
        "answers are gibberish. Set the stage's `model` to a local directory for real answers.",
        model,
        path,
    )
    return str(path), True
