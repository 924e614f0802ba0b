"""The nemesis suite's CI run: every fault class, and nothing lost, stale or wedged.

``python -m chaos --ci`` (seeded, about two minutes) starts a real Redis with
the shipped persistence (one server; then, with ``--redis-cluster``, a Redis
Cluster of 3 primaries with replicas, whose primaries the nemesis kills), two
coordinators, the control plane and two workers on each of two chained
stages, drives twenty WebSocket clients through them
while the nemesis kills, pauses and restarts processes and drops sockets, and
checks the clients' histories (see ``chaos``). This test runs it as a user
would and asserts on its report.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chaos.checker import COUNTS
from chaos.nemesis import FAULTS
from tests.processes import ROOT


@pytest.mark.timeout(400)
@pytest.mark.parametrize("redis", ["single", "cluster"])
def test_the_nemesis_ci_run_finds_nothing(tmp_path, redis):
    report = tmp_path / "report.json"
    mode = ["--redis-cluster"] if redis == "cluster" else []
    run = subprocess.run(
        [sys.executable, "-m", "chaos", "--ci", *mode, "--workdir", str(tmp_path / "run"),
         "--report", str(report)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert {name: result["totals"][name] for name in COUNTS} == dict.fromkeys(COUNTS, 0), (
        json.dumps([c for c in result["per_client"] if c["examples"]], indent=1)[:4000]
    )
    assert all(result["faults"][kind] >= 1 for kind in FAULTS), result["faults"]
    assert result["operations"]["ack"] > 1000 and result["operations"]["cancel_sent"] > 100
    assert result["ok"] and run.returncode == 0
