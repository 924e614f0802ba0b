"""How the commands find the stack that ``duplexq up`` runs in a workdir.

``up`` holds an exclusive ``flock`` on ``<workdir>/up.lock`` for as long as it lives
(the kernel releases it however ``up`` ends, kill -9 included) and writes what the
other commands need to reach its stack to ``<workdir>/up.json``: its pid, its Redis,
its key prefix, its pipeline and the client API's address. A command run beside it
(same directory, or ``--workdir`` naming the same workdir) with no Redis of its own
configured (no ``--redis-url``, ``DUPLEXQ_REDIS_URL`` or ``redis_url`` in a settings
file) uses that stack's, and says so on stderr. The lock, not the file, says whether
the stack runs: a file left by a stack that died is ignored.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dataplane.config import load_settings, redacted
from schemas.config import Settings

LOCK_FILE = "up.lock"
STATE_FILE = "up.json"
DEFAULT_WORKDIR = "var"


@dataclass(frozen=True)
class RunningStack:
    """What ``up.json`` says about the stack running in ``workdir``."""

    workdir: Path
    pid: int
    redis_url: str = ""
    """Empty while ``up`` is still starting its Redis."""
    key_prefix: str = ""
    pipeline: str = ""
    base_url: str = ""
    """The client API (``http://host:port``); empty until the coordinator answers."""

    def describe(self) -> str:
        parts = [f"pid {self.pid}"]
        if self.base_url:
            parts.append(self.base_url)
        if self.redis_url:
            parts.append(f"Redis at {redacted(self.redis_url)}")
        return f"{self.workdir} ({', '.join(parts)})"


@dataclass
class StackLock:
    """``up``'s hold on its workdir, and the state file it publishes there."""

    workdir: Path
    fields: dict[str, object] = field(default_factory=dict)
    _fd: int | None = None

    def acquire(self) -> RunningStack | None:
        """Take the workdir; the stack already running there instead, if one is."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return running(self.workdir) or RunningStack(self.workdir, pid=0)
        self._fd = fd
        self.publish(pid=os.getpid())
        return None

    def publish(self, **fields: object) -> None:
        """Add ``fields`` to the state file (written whole, then renamed into place)."""
        self.fields.update(fields)
        tmp = self.workdir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.fields) + "\n")
        tmp.replace(self.workdir / STATE_FILE)

    def release(self) -> None:
        """Remove the state file and let the workdir go."""
        if self._fd is None:
            return
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        os.close(self._fd)  # closing the descriptor releases the lock
        self._fd = None


def running(workdir: Path) -> RunningStack | None:
    """The stack ``up`` runs in ``workdir``, or None when no ``up`` holds it."""
    try:
        fd = os.open(workdir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it: whatever up.json says is stale
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    try:
        data = json.loads((workdir / STATE_FILE).read_text())
    except (OSError, ValueError):
        data = {}
    known = {name: data[name] for name in RunningStack.__dataclass_fields__ if name in data}
    known.pop("workdir", None)
    known.setdefault("pid", 0)
    return RunningStack(workdir, **known)


def add_workdir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        default=DEFAULT_WORKDIR,
        help="the workdir of `duplexq up` (default: var), where it keeps its Redis data, logs "
        "and state; a command with no Redis configured uses the stack running there",
    )


def settings_for(args: argparse.Namespace, command: str) -> Settings:
    """The settings of a command run beside ``up``: as configured, or, when no Redis is
    configured and a stack runs in ``args.workdir``, pointing at that stack's Redis, key
    prefix and (unless one is configured) pipeline."""
    settings = load_settings(args.settings, args.redis_url)
    if "redis_url" in settings.model_fields_set:
        return settings
    stack = running(Path(args.workdir).resolve())
    if stack is None or not stack.redis_url:
        return settings
    update: dict[str, object] = {"redis_url": stack.redis_url}
    if stack.key_prefix and "key_prefix" not in settings.model_fields_set:
        update["key_prefix"] = stack.key_prefix
    if stack.pipeline and "pipeline" not in settings.model_fields_set and not args.pipeline:
        update["pipeline"] = stack.pipeline
    print(
        f"duplexq {command}: using the stack running in {stack.describe()}",
        file=sys.stderr,
        flush=True,
    )
    return settings.model_copy(update=update)
