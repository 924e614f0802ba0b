"""The default stack as ``duplexq up`` ships it, started once for the whole test session.

Tests of what a user meets (the voice-agent frameworks, the shipped model's answers,
replaying a voice session) share one ``duplexq up --workers 1`` on the default
pipeline: its shipped options, the model ``scripts/setup`` prepared, its own Redis in
its own workdir. Loading every stage takes minutes on 2 CPU cores, so it is started
once (the ``shipped_stack`` fixture in conftest) and stopped when the session ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.processes import ROOT
from tests.redis_server import free_port

API_KEY = "sk-shipped-stack-test"
START_S = 600
"""How long the default stack may take to load every stage (vLLM on 2 CPU cores)."""


class StackFailed(RuntimeError):
    """``duplexq up`` exited or did not serve in time; the message holds its log."""


@dataclass(frozen=True)
class ShippedStack:
    port: int
    workdir: Path
    env: dict[str, str]
    api_key: str = API_KEY

    @property
    def realtime_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    @property
    def log(self) -> str:
        return (self.workdir / "up.log").read_text()

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``duplexq ARGS --workdir W`` beside the stack, as a user runs it."""
        return subprocess.run(
            [sys.executable, "-m", "coordinator.launcher.cli", *args,
             "--workdir", str(self.workdir)],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip


@contextmanager
def serve_shipped_stack(workdir: Path) -> Iterator[ShippedStack]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DUPLEXQ_API_KEYS": API_KEY,
        "DUPLEXQ_MODELS_DIR": str(ROOT / "var" / "models"),  # what scripts/setup prepared
    }
    stack = ShippedStack(port, workdir, env)
    with (workdir / "up.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.launcher.cli", "up", "--port", str(port),
             "--workers", "1", "--no-demo", "--workdir", str(workdir)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_S
            while "\nserving; " not in stack.log:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StackFailed("duplexq up did not start:\n" + stack.log)
                time.sleep(0.5)
            yield stack
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
