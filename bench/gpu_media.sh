#!/usr/bin/env bash
# bench/gpu_media.sh: on a CUDA machine with the real MiniCPM-o 4.5 checkpoint,
# check that vLLM's MiniCPM-o processor expands every duplex unit the
# minicpmo stage sends to exactly the stage's token budget (12 tokens per
# whole second of audio, 66 per image block, MiniCPM-V slicing for a stacked
# pair's base frame). See bench/gpu_minicpmo_media.py for what is fed and how
# it is compared; it prints a table and writes bench/gpu-minicpmo-media.json.
#
#   DUPLEXQ_MINICPMO_MODEL=/models/MiniCPM-o-4_5 bench/gpu_media.sh
#
# Needs: a Python with vLLM (CUDA build) and duplexq's dependencies
# ($DUPLEXQ_PYTHON, else the project's .venv, else python3; bench/gpu.sh can
# build var/gpu-venv), and the checkpoint on local disk or in the Hugging Face
# cache: nothing is downloaded (HF_HUB_OFFLINE=1). No Redis: the script calls
# the stage directly. Time: one engine start of a ~9B model plus 7 short
# requests, under `timeout` (DUPLEXQ_GPU_BUDGET_S, default 540 s).
# Exit status: 0 every unit matches its budget, 1 one does not, 2 the engine
# did not start, 124 out of time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PY=""
for candidate in "${DUPLEXQ_PYTHON:-}" "$ROOT/.venv/bin/python" "$ROOT/var/gpu-venv/bin/python" \
  "$(command -v python3 || true)"; do
  if [[ -n "$candidate" && -x "$candidate" ]] && "$candidate" -c "import vllm, torch" 2>/dev/null; then
    PY="$candidate"
    break
  fi
done
if [[ -z "$PY" ]]; then
  echo "gpu_media.sh: no Python with vLLM; set DUPLEXQ_PYTHON or run bench/gpu.sh once" >&2
  exit 3
fi
echo "gpu_media.sh: python $PY ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
timeout --signal=TERM --kill-after=15 "${DUPLEXQ_GPU_BUDGET_S:-540}" \
  "$PY" -m bench.gpu_minicpmo_media --model "${DUPLEXQ_MINICPMO_MODEL:-openbmb/MiniCPM-o-4_5}" "$@"
