"""Structured logs: one JSON object per line, with the session and fence when known.

Code logs with ``extra={"session": sid, "fence": fence}``; the formatter puts
those next to time, level, logger and message, so logs of one session can be
followed across coordinators and workers with a plain ``grep``/``jq``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = ("session", "fence", "stage", "worker", "code")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = str(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "INFO", *, json_lines: bool = True) -> None:
    """Configure the root logger once for a duplexq process."""
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def session_extra(session_id: str, fence: object = None, **more: object) -> dict[str, object]:
    """``extra=`` for a log call about one session."""
    return {"session": session_id, "fence": fence, **more}


class WithoutQueryStrings(logging.Filter):
    """Cuts the query string off every request path a record's arguments carry.

    A query string may hold a credential a client put in its URL by mistake; the
    HTTP server's access and WebSocket lines log the path with it (as an argument of
    the record), so those loggers carry this filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                arg.split("?", 1)[0] if isinstance(arg, str) and arg.startswith("/") else arg
                for arg in record.args
            )
        return True
