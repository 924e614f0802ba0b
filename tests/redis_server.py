"""A real redis-server for tests: own port, own temp dir, started and stopped here.

It persists as every Redis duplexq starts does (``REDIS_PERSISTENCE``: AOF,
fsync before each reply), so what the tests prove holds for what ships.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from schemas.config import REDIS_PERSISTENCE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process; ``restart()`` keeps its data dir (and AOF)."""

    def __init__(
        self, workdir: Path, *, appendonly: bool = True, extra: Sequence[str] = ()
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; run scripts/setup")
        self.binary = binary
        self.workdir = workdir
        self.appendonly = appendonly
        """False only for a test that needs a Redis which forgets (none by default); a
        duplexq process started on it refuses it unless ``redis_durability`` is
        ``relaxed`` (``dataplane.redis_config``)."""
        self.extra = list(extra)
        """More redis-server options (a cluster node's)."""
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            *(REDIS_PERSISTENCE if self.appendonly else ("--appendonly", "no")),
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server exited early:\n{log[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                if self._ping():
                    return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start within 10 s")

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Kill the server (no shutdown save) and start it again on the same port."""
        self.stop(signal.SIGKILL)
        self.start()
