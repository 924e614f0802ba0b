"""The page's parts about persistence: sections 1-3 on a Redis without it, and what the
fsync costs per event on the shipped one (``bench.fsync`` measures it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.fsync import TWINNED
from bench.mdformat import f, table, x

TWIN_LABEL = ", Redis without persistence"
TIMES_LABEL = ", on a Redis without persistence"


def twins(ok: dict[str, Any]) -> dict[str, Any]:
    """The twin results of the ``TWINNED`` sections, by section name."""
    return {name: ok[name]["unpersisted"] for name in TWINNED
            if isinstance(ok.get(name, {}).get("unpersisted"), dict)}  # fmt: skip


def beside_twins(rows: list[list[Any]], twin_rows: list[list[Any]]) -> list[list[Any]]:
    """Each summary row followed by the same figure measured without persistence."""
    labelled = [[row[0], f"{row[1]}{TWIN_LABEL}", *row[2:]] for row in twin_rows]
    if len(labelled) != len(rows):
        return rows + labelled
    return [row for pair in zip(rows, labelled, strict=True) for row in pair]


def _tables(text: str) -> list[str]:
    """The markdown tables of a rendered section, in order."""
    found: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("|"):
            if not inside:
                found.append([])
            found[-1].append(line)
        inside = line.startswith("|")
    return ["\n".join(lines) for lines in found]


def twin_tables(render: Callable[[dict[str, Any] | None], str], s: dict[str, Any] | None) -> str:
    """The tables of a section rendered from its twin run, under a heading of their own;
    empty when the section has no twin."""
    if not s or "error" in s or "unpersisted" not in s:
        return ""
    twin = s["unpersisted"]
    title = render(twin).splitlines()[0].removeprefix("## ")
    out = [f"### {title}{TIMES_LABEL}", ""]
    if "error" in twin:
        return "\n".join([*out, f"_The run without persistence failed: `{twin['error']}`._"])
    out.append("The same measurements, in the same run, on a twin Redis with the AOF off\n"
               "(each against the raw limit measured on such a Redis); the tables in the\n"
               "order of those above.\n")  # fmt: skip
    return "\n".join(out) + "\n" + "\n\n".join(_tables(render(twin)))


def _get(s: dict[str, Any] | None, *path: Any) -> Any:
    for key in path:
        if isinstance(s, dict):
            s = s.get(key)
        elif isinstance(s, list) and isinstance(key, int) and -len(s) <= key < len(s):
            s = s[key]
        else:
            return None
    return s


def _per_s(eps: Any, per_fsync: Any) -> Any:
    return eps / per_fsync if eps and per_fsync else None


def _wait_us(fsync_ms: Any, per_fsync: Any) -> Any:
    return 1000 * fsync_ms / per_fsync if fsync_ms and per_fsync else None


def fsync_section(sections: dict[str, Any]) -> str:
    out = ["### What the fsync costs, and how the pipeline shares it", ""]
    raw, tp = sections.get("raw"), sections.get("throughput")
    if not raw or "error" in raw or not raw.get("persistent"):
        return "\n".join([*out, "_Not measured in the last run of section 1._"])
    disk = raw.get("fsync_time", {})
    one = _get(tp, "points", 0) or {}
    twin_one = _get(tp, "unpersisted", "points", 0) or {}
    raw_eps, raw_twin = _get(raw, "batched", "events_per_s"), _get(
        raw, "unpersisted", "batched", "events_per_s")  # fmt: skip
    raw_per = _get(raw, "batched", "fsync", "events_per_fsync")
    one_per = _get(one, "fsync", "events_per_fsync")
    median = _get(tp, "paired", "median") or {}
    twin_median = _get(tp, "unpersisted", "paired", "median") or {}
    out.append(
        "With `appendfsync always` Redis writes the commands of one turn of its event loop\n"
        "to the AOF and fsyncs it once, before it sends that turn's replies: every write of\n"
        "the turn waits for that one disk sync and shares it (group commit). An event's\n"
        "share is the fsync's time divided by the events one fsync covers. The fsyncs are\n"
        "counted in the kernel while each run goes (`perf stat` on Redis's `fdatasync`\n"
        "calls, `bench/fsync.py`); one fsync is timed apart, writing 1,300 bytes and\n"
        f"syncing them in Redis's own directory: p50 {f(disk.get('p50_ms'), 3)} ms, p99 "
        f"{f(disk.get('p99_ms'), 3)} ms on this disk.\n"
    )
    rows = [
        ["events/s, shipped persistence", f(raw_eps, 0), f(one.get("events_per_s"), 0)],
        ["events/s, without persistence", f(raw_twin, 0), f(twin_one.get("events_per_s"), 0)],
        ["with / without",
         x(raw_eps / raw_twin) if raw_eps and raw_twin else "-",
         x(one["events_per_s"] / twin_one["events_per_s"])
         if one.get("events_per_s") and twin_one.get("events_per_s") else "-"],
        ["fsyncs per second", f(_per_s(raw_eps, raw_per), 0),
         f(_per_s(one.get("events_per_s"), one_per), 0)],
        ["events per fsync", f(raw_per, 1), f(one_per, 1)],
        ["fsync wait per event (p50 fsync / events per fsync)",
         f"{f(_wait_us(disk.get('p50_ms'), raw_per), 1)} us",
         f"{f(_wait_us(disk.get('p50_ms'), one_per), 1)} us"],
    ]  # fmt: skip
    out.append(table(["", "raw batched stream", "pipeline, 1 echo worker, saturated"], rows))
    if median:
        out.append(
            f"\nSide by side (section 3's pairs, median pair): one worker at "
            f"**{x(median.get('ratio'))}** the raw batched stream with both on the shipped\n"
            f"persistence ({f(median.get('events_per_fsync'), 1)} events per fsync against "
            f"{f(median.get('raw_events_per_fsync'), 1)}), {x(twin_median.get('ratio'))} "
            "with both without it."
        )
    out.append(
        "\nA raw message is written by three clients (the producer's XADD, the peer's XACK\n"
        "and XADD, the consumer's XACK), each in its own pipeline that Redis mostly reads\n"
        "in a turn of its own, so one fsync covers a few messages. The pipeline sends\n"
        "Redis fewer, fuller rounds: a coordinator's appends of one turn of its event loop\n"
        "go as one script call (`dataplane/batching.py`, `append_batch` 0: the whole\n"
        "turn's calls in one batch), and a worker's publishes of a turn likewise, so one\n"
        "fsync covers every session's append of that turn. The slower the disk, the more\n"
        "that sharing is worth: an event's fsync wait is the fsync's time over the events\n"
        "it covers."
    )
    return "\n".join(out)
