"""Worker processes for fault tests: start, SIGKILL, SIGSTOP/SIGCONT, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from schemas.config import PipelineConfig, Settings

ROOT = Path(__file__).resolve().parent.parent


def write_pipeline(directory: Path, pipeline: PipelineConfig) -> Path:
    path = directory / f"pipeline-{pipeline.name}.json"
    path.write_text(pipeline.model_dump_json())
    return path


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as the DUPLEXQ_* environment a worker process reads."""
    return {f"DUPLEXQ_{name.upper()}": str(value) for name, value in settings.model_dump().items()}


class WorkerProcess:
    """``python -m workers`` in a child process, with its log in a file."""

    def __init__(
        self,
        settings: Settings,
        pipeline_path: Path,
        stage: str,
        worker_id: str,
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        self.args = [
            sys.executable, "-m", "workers", "--stage", stage,
            "--pipeline", str(pipeline_path), "--worker-id", worker_id,
        ]  # fmt: skip
        self.env = {**os.environ, **settings_env(settings), **(env or {})}
        self.env["PYTHONPATH"] = str(ROOT)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def wait_for_file(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear within {timeout} s")
