"""8. vLLM time to first token: through the pipeline vs the same engine called directly.

``python -m bench.gpu_ttft`` (run by ``bench/gpu.sh``) builds the tiny
Qwen2-architecture model of ``tests.tiny_model`` locally (no download), then:

- **direct**: starts a vLLM engine (``workers.backends.vllm_engine``, the
  wrapper the ``vllm`` stage uses) in this process and, one request at a
  time, renders the chat prompt, tokenizes it and generates; TTFT is from
  the call to the first streamed token;
- **pipeline**: shuts that engine down, starts a private redis-server and a
  ``vllm`` stage worker process (``python -m workers``) with the same engine
  options, and through a ``Coordinator`` opens a fresh session per request,
  appends the same user text and commits the turn; TTFT is from the commit
  call to the first ``text_delta`` the output reader delivers.

Same prompt, same sampling (greedy, ``--max-tokens`` per response), one
request in flight, warm-up requests first. Prints p50/p99 of both and their
ratio, and writes them as JSON. On a machine without CUDA it refuses unless
``--allow-cpu`` (a smoke test of the script itself with the CPU build).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    PrivateRedis,
    WorkerPool,
    bench_settings,
    now_ns,
    ratio,
    summarize_ns,
    wait_workers,
)

STAGE = "thinker"
PROMPT = "hello there"


def engine_options(model_dir: str, *, gpu: bool, max_tokens: int, eager: bool) -> dict[str, Any]:
    """Options of the ``vllm`` stage (and of the direct engine: the same ones)."""
    options: dict[str, Any] = {
        "model": model_dir, "max_model_len": 1024, "seed": 0, "temperature": 0.0,
        "max_tokens": max_tokens, "enforce_eager": eager,
    }  # fmt: skip
    if gpu:
        options.update({"dtype": "bfloat16", "kv_cache_memory_bytes": 1 << 30})
    else:
        options.update({"dtype": "float32", "kv_cache_memory_bytes": 64 << 20})
    return options


async def direct(options: dict[str, Any], requests: int, warmup: int) -> list[int]:
    from workers.backends.vllm_engine import SamplingSpec, VllmEngine
    from workers.backends.vllm_options import parse_options

    engine = VllmEngine(parse_options(STAGE, options))
    began = time.monotonic()
    await engine.ready()
    print(f"direct: engine started in {time.monotonic() - began:.1f} s", flush=True)
    spec = SamplingSpec(options["max_tokens"], 0.0, 1.0, 0)
    samples: list[int] = []
    try:
        for i in range(warmup + requests):
            t0 = now_ns()
            ids = engine.encode(engine.render([{"role": "user", "content": PROMPT}]))
            first = 0
            async for step in engine.generate(ids, spec, f"direct-{i}"):
                if not first and step.token_ids:
                    first = now_ns()
            if i >= warmup:
                samples.append(first - t0)
    finally:
        await engine.shutdown()
    return samples


async def through_pipeline(
    options: dict[str, Any], requests: int, warmup: int, log_dir: Path
) -> list[int]:
    from coordinator.service import Coordinator
    from schemas.config import PipelineConfig, StageConfig
    from schemas.events import InputMode, OutputEvent, OutputKind, TextPayload

    server = PrivateRedis(log_dir / "redis").start()
    stage = StageConfig(name=STAGE, backend="vllm", to_client=True, options=options)
    pipeline = PipelineConfig(name="gpu-ttft", stages=(stage,))
    settings = bench_settings(server, "gpu", worker_capacity=warmup + requests + 1)
    pool = WorkerPool(settings, pipeline, STAGE, log_dir)
    coordinator = Coordinator(settings, pipeline)
    samples: list[int] = []
    try:
        worker = pool.spawn("vllm-worker")
        await wait_workers(coordinator.bus, STAGE, 1, limit_s=120)
        for i in range(warmup + requests):
            sid = f"ttft-{i}"
            await coordinator.open(sid)
            await coordinator.append(sid, InputMode.APPEND_TEXT, TextPayload(PROMPT))
            t0 = now_ns()
            await coordinator.commit(sid)
            first = 0
            done = False
            limit = now_ns() + int((300 if i == 0 else 60) * 1e9)
            while not done:
                if now_ns() > limit:
                    raise TimeoutError(f"no answer for {sid}; worker log:\n{worker.log()[-2000:]}")
                for delivery in await coordinator.outputs(block_ms=50):
                    event = delivery.event
                    if not isinstance(event, OutputEvent) or delivery.session_id != sid:
                        continue
                    if event.kind is OutputKind.TEXT_DELTA and not first:
                        first = now_ns()
                    done = done or event.kind in (OutputKind.DONE, OutputKind.ERROR)
            if i == 0:
                print(f"pipeline: first answer (engine start included) after "
                      f"{(now_ns() - t0) / 1e9:.1f} s", flush=True)  # fmt: skip
            if i >= warmup and first:
                samples.append(first - t0)
            await coordinator.close(sid)
    finally:
        await coordinator.aclose()
        pool.stop_all(kill=False)
        server.stop()
    return samples


def device_name(gpu: bool) -> str:
    if not gpu:
        return "CPU (smoke test of the script, not a GPU figure)"
    import torch

    return str(torch.cuda.get_device_name(0))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tests.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="duplexq-gpu-"))
    try:
        model_dir = str(build_tiny_model(work / "model"))
        options = engine_options(model_dir, gpu=not args.allow_cpu, max_tokens=args.max_tokens,
                                 eager=args.eager)  # fmt: skip
        direct_ns = await direct(options, args.requests, args.warmup)
        pipeline_ns = await through_pipeline(options, args.requests, args.warmup, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    d, p = summarize_ns(direct_ns), summarize_ns(pipeline_ns)
    import vllm

    return {
        "direct": d,
        "pipeline": p,
        "ratio_p50": ratio(p["p50_ms"], d["p50_ms"]),
        "ratio_p99": ratio(p["p99_ms"], d["p99_ms"]),
        "added_p50_ms": round(p["p50_ms"] - d["p50_ms"], 3),
        "added_p99_ms": round(p["p99_ms"] - d["p99_ms"], 3),
        "device": device_name(not args.allow_cpu),
        "vllm": getattr(vllm, "__version__", "unknown"),
        "model": "tiny Qwen2 (tests/tiny_model.py), built locally",
        "engine_options": {k: v for k, v in options.items() if k != "model"},
        "requests": args.requests,
        "warmup": args.warmup,
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_ttft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager (no CUDA graphs: faster start)")  # fmt: skip
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (smoke test)")
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON result (default bench/gpu-results.json; "
        "with --allow-cpu a file in the temp dir, never the GPU figures)",
    )
    args = parser.parse_args(argv)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
        os.environ.setdefault(name, "1")
    if not args.allow_cpu:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device; bench/gpu.sh is for a GPU machine (--allow-cpu to smoke-test)",
                  file=sys.stderr)  # fmt: skip
            return 2
    if args.out is None:
        cpu_out = Path(tempfile.gettempdir()) / "duplexq-gpu-results-cpu.json"
        args.out = cpu_out if args.allow_cpu else Path("bench/gpu-results.json")
    result = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    d, p = result["direct"], result["pipeline"]
    for label, s in (("direct  ", d), ("pipeline", p)):
        print(f"TTFT {label} p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  "
              f"({s['count']} requests)")  # fmt: skip
    print(f"ratio pipeline/direct: p50 {result['ratio_p50']}x  p99 {result['ratio_p99']}x; "
          f"added p50 {result['added_p50_ms']} ms; written to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
