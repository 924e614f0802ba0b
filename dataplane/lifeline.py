"""A child of ``duplexq up`` dies with it, however ``up`` dies (kill -9 included).

``up`` keeps the write end of a pipe and hands each Python child the read end
(``DUPLEXQ_LIFELINE_FD``). The child watches it from a thread: when ``up`` exits the
kernel closes the write end, the read returns end-of-file, and the child kills its
whole process group with SIGKILL. ``up`` starts every child in a session of its own,
so that group is the child and everything it started (a worker's vLLM engine
processes included), and nothing else. A child that is not Python (Redis) gets the
kernel's parent-death signal instead (``die_with_parent``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable

LIFELINE_ENV = "DUPLEXQ_LIFELINE_FD"
"""The variable that gives a child the read end of ``up``'s lifeline."""
_PR_SET_PDEATHSIG = 1


def watch() -> None:
    """If this process was started with a lifeline, kill its process group when the
    lifeline breaks. The variable is removed so that the process's own children do not
    watch a descriptor they do not hold."""
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None:
        return
    fd = int(value)
    threading.Thread(target=_wait_and_die, args=(fd,), name="lifeline", daemon=True).start()


def _wait_and_die(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    if os.getpgrp() == os.getpid():  # up's children lead their own group
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the thread that
    started it exits (``prctl(PR_SET_PDEATHSIG)``; Linux only). Resolved before the
    fork: the child only makes the call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody will tell
            os._exit(1)

    return preexec
