#!/usr/bin/env bash
# bench/gpu.sh: vLLM time to first token through the duplexq pipeline vs the
# same engine called directly, on a CUDA machine, offline, in under 8 minutes.
#
#   bench/gpu.sh                      # 50 timed requests each way (after 5 warm-ups)
#   bench/gpu.sh --requests 100       # options go to python -m bench.gpu_ttft
#   DUPLEXQ_GPU_WHEELS=/wheels bench/gpu.sh   # install missing packages from a wheel dir
#   bench/gpu.sh --allow-cpu          # smoke-test the script with the CPU build (not a figure)
#
# What it needs on the machine, and what it does when something is missing:
#
# - Python 3.11+ with vLLM (CUDA build) and duplexq's dependencies. It uses, in
#   order: $DUPLEXQ_PYTHON, the project's .venv, then python3, whichever can
#   import vllm, torch, transformers, redis, msgspec and pydantic. If none
#   can, it creates var/gpu-venv (git-ignored) and installs '.[gpu]' there.
#   That is the only step that needs packages from outside: pip must reach an index, or
#   DUPLEXQ_GPU_WHEELS must name a directory of wheels (then pip runs with
#   --no-index). With vLLM already installed nothing is fetched.
# - redis-server on PATH, or $REDIS_SERVER pointing at one (a copy of Debian's
#   binary works; the script starts its own on a free port, data in a temp dir).
# - No network at run time: the model is built locally (tests/tiny_model.py:
#   a 2-layer Qwen2 with a byte-level BPE tokenizer, about a second to build)
#   and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set.
#
# Time: two engine starts (one per side) and 2 x 55 short requests; the
# python step runs under `timeout` so the whole script stays below 8 minutes.
# The result is printed and written to bench/gpu-results.json, which
# `python -m bench --report-only` puts into docs/benchmarks.md (section 8).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S=${DUPLEXQ_GPU_BUDGET_S:-450}
started=$SECONDS

has_deps() {
  "$1" - <<'EOF' >/dev/null 2>&1
import sys
assert sys.version_info >= (3, 11)
import msgspec, pydantic, redis, tokenizers, torch, transformers, vllm  # noqa: F401
EOF
}

pick_python() {
  local candidate
  for candidate in "${DUPLEXQ_PYTHON:-}" "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]] && has_deps "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! PY="$(pick_python)"; then
  echo "gpu.sh: no Python with vLLM and duplexq's dependencies; installing '.[gpu]' into var/gpu-venv" >&2
  base="$(command -v python3.12 || command -v python3.11 || command -v python3)"
  mkdir -p var
  [[ -x var/gpu-venv/bin/python ]] || "$base" -m venv var/gpu-venv
  pip_args=(--quiet --disable-pip-version-check)
  if [[ -n "${DUPLEXQ_GPU_WHEELS:-}" ]]; then
    pip_args+=(--no-index --find-links "$DUPLEXQ_GPU_WHEELS")
  fi
  if ! var/gpu-venv/bin/python -m pip install "${pip_args[@]}" -e ".[gpu]"; then
    echo "gpu.sh: installing '.[gpu]' failed. Without network access, preinstall vLLM (CUDA" >&2
    echo "build) or set DUPLEXQ_GPU_WHEELS to a directory holding vllm, torch and" >&2
    echo "duplexq's dependencies as wheels." >&2
    exit 3
  fi
  PY="$ROOT/var/gpu-venv/bin/python"
fi

if [[ -n "${REDIS_SERVER:-}" ]]; then
  PATH="$(dirname "$REDIS_SERVER"):$PATH"
fi
if ! command -v redis-server >/dev/null; then
  echo "gpu.sh: redis-server not found; install it (apt-get install redis-server) or set REDIS_SERVER" >&2
  exit 3
fi

echo "gpu.sh: python $PY ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

left=$((BUDGET_S - (SECONDS - started)))
if ((left < 60)); then
  echo "gpu.sh: setup took $((SECONDS - started)) s; not enough of the budget is left" >&2
  exit 4
fi
status=0
timeout --signal=TERM --kill-after=15 "$left" "$PY" -m bench.gpu_ttft "$@" || status=$?
if ((status == 124)); then
  echo "gpu.sh: stopped after ${left} s to stay within the budget; try fewer --requests" >&2
fi
echo "gpu.sh: done in $((SECONDS - started)) s"
exit "$status"
