"""What the tracing code costs while tracing is off, side by side with a tree without it.

``python -m bench.trace_cost OTHER_TREE`` runs the same measurement alternately on this
checkout (tracing code present, ``OTEL_EXPORTER_OTLP_ENDPOINT`` unset) and on
``OTHER_TREE`` (a checkout of the product before tracing, e.g. ``git archive`` of an
older commit unpacked there), each run in a fresh child process: ``bench.coalesce``'s
session actors of a client-facing stage streaming answers at full speed with
coalescing off (one publish per output: the per-output path at its busiest), on a
private redis-server. It prints the CPU per output of the actors' process for every
run and the medians; ``docs/tracing.md`` quotes them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT

REPEATS = 5

CHILD = """
import asyncio, json
from bench.coalesce import Load, run_one
from bench.common import private_redis

async def main():
    with private_redis("trace-cost") as server:
        row = await run_one(server.url, server.pid, "tc", 0.0, 0, Load(answers=20))
    print(json.dumps(row["worker_cpu_us_per_token"]))

asyncio.run(main())
"""


def _one(tree: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tree)
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    other = Path(args[0]).resolve()
    runs: dict[str, list[float]] = {"this": [], "other": []}
    for repeat in range(REPEATS):
        for name, tree in (("this", ROOT), ("other", other)):
            runs[name].append(_one(tree))
            print(f"run {repeat + 1} {name}: {runs[name][-1]} us CPU per output", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(json.dumps({"runs": runs, "medians": medians,
                      "ratio": round(medians["this"] / medians["other"], 3)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
