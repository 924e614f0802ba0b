"""Formatting for the generated benchmark page: table cells, ratios, tables."""

from __future__ import annotations

import math
from typing import Any


def f(value: Any, digits: int = 2) -> str:
    """A number for a table cell ("-" when missing)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def x(value: Any) -> str:
    """A ratio cell."""
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value:.2f}x")
    )


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]  # fmt: skip
    return "\n".join(lines)


def failed(name: str, section: dict[str, Any] | None) -> str | None:
    if section is None:
        return f"_Not run in the last run (`python -m bench --only {name}`)._"
    if "error" in section:
        return f"_This section failed in the last run: `{section['error']}`._"
    return None


def ms_pair(summary: dict[str, Any]) -> str:
    return f"{f(summary.get('p50_ms'))} / {f(summary.get('p99_ms'))} ms"


def cpu_us(per: dict[str, float] | None) -> str:
    if not per:
        return "-"
    parts = [f"{k} {v:,.0f}" for k, v in per.items() if k != "total"]
    return f"**{per.get('total', math.nan):,.0f}** ({', '.join(parts)})"
