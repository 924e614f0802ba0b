"""The sections of docs/benchmarks.md, one function each, from their results.

Each prints how its figures are measured, then a table that puts every figure
next to its reference and their ratio.
"""

from __future__ import annotations

import json
import math
from typing import Any

from bench import scaleout
from bench.common import ROOT
from bench.mdformat import cpu_us, f, failed, ms_pair, table, x
from bench.throughput import CORES, per_worker_rows

GPU_RESULTS = ROOT / "bench" / "gpu-results.json"


def raw_section(s: dict[str, Any] | None) -> str:
    out = ["## 1. The raw limit (the floor)", ""]
    if (msg := failed("raw", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    rtt, hop = s["round_trip"], s["hop"]
    rb = s.get("redis_benchmark", {})
    single, piped = rb.get("single_client", {}), rb.get("pipelined", {})
    out.append(
        "A hop is XADD by the sender, a blocking XREADGROUP by the receiver and XACK; the\n"
        "pipeline's shortest path (coordinator -> stage -> coordinator) is two hops. The\n"
        "**raw round trip** makes those two hops from Python with the client library\n"
        "duplexq uses (redis-py asyncio + hiredis), a 1,280-byte payload (40 ms of 16 kHz\n"
        "16-bit audio) and a bare echo process (`bench/raw_peer.py`) in place of the\n"
        "worker: no fences, leases, Lua or encoding. It is the reference for every latency\n"
        "below. The raw streams push many messages through the same two hops: *unbatched*\n"
        "with one command per message on every side (64 concurrent senders, as many as\n"
        "the throughput benchmark's sessions), *batched* with 64 messages per pipeline, read and\n"
        "ack. They are the references for throughput, and their CPU time per message the\n"
        "reference for what an event costs.\n"
    )
    rows = [
        ["raw round trip (2 hops), one in flight", f(rtt["p50_ms"], 3), f(rtt["p99_ms"], 3),
         f(1000 / rtt["mean_ms"] if rtt["mean_ms"] else math.nan, 0), "-", f(rtt["count"])],
        ["one hop, XADD -> XREADGROUP returns", f(hop["p50_ms"], 3), f(hop["p99_ms"], 3), "-",
         "-", f(hop["count"])],
    ]  # fmt: skip
    for label, key in (("raw stream, unbatched", "unbatched"), ("raw stream, batched", "batched")):
        st = s[key]
        rows.append([label, f(st["latency_under_load"]["p50_ms"], 1),
                     f(st["latency_under_load"]["p99_ms"], 1), f(st["events_per_s"], 0),
                     cpu_us(st.get("cpu_us_per_event")), f(st["events"])])  # fmt: skip
    for label, key in (("Python XADD alone, 1 in flight", "xadd_sequential"),
                       ("Python XADD alone, 64 in flight", "xadd_concurrent")):  # fmt: skip
        if key in s:
            st = s[key]
            rows.append([label, f(st["latency"]["p50_ms"], 3), f(st["latency"]["p99_ms"], 3),
                         f(st["events_per_s"], 0), cpu_us(st.get("cpu_us_per_event")),
                         f(st["events"])])  # fmt: skip
    for label, bench in (("redis-benchmark XADD, 1 client, no pipelining", single),
                         ("redis-benchmark XADD, 50 clients, pipeline 16", piped)):  # fmt: skip
        if bench.get("measured"):
            rows.append([label, f(bench["p50_ms"], 3), f(bench["p99_ms"], 3),
                         f(bench["events_per_s"], 0), "-", f(bench["requests"])])  # fmt: skip
        else:
            rows.append([label, "-", "-", bench.get("reason", "not measured"), "-", "-"])
    out.append(table(["figure", "p50 ms", "p99 ms", "events/s", "CPU us per event",
                      "samples"], rows))  # fmt: skip
    out.append(
        "\nThe streams' latencies are under load (producers running ahead of the consumer),\n"
        "not a floor. redis-benchmark is a C client: the gap between its XADD rate and the\n"
        "Python streams is the cost of Python clients, before any duplexq code runs. CPU\n"
        "microseconds per event are summed over the processes involved (client, peer,\n"
        "redis); unlike latency they barely change with other load on the machine."
    )
    if runs := s["batched"].get("runs_events_per_s"):
        out.append(
            f"\nThe batched stream was run {len(runs)} times; its row is the median run "
            f"(events/s of the runs: {', '.join(f(r, 0) for r in runs)})."
        )
    return "\n".join(out)


def latency_section(s: dict[str, Any] | None) -> str:
    out = ["## 2. Per-hop latency under load", ""]
    if (msg := failed("latency", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "Each session sends a 40 ms audio chunk every 40 ms (25 events/s), sessions\n"
        "staggered over the period, through coordinator -> one echo worker process ->\n"
        "output reader. A chunk's latency runs from the moment it is handed to\n"
        "`Coordinator.append` to the moment `Coordinator.outputs` returns its echo (one\n"
        "process, one clock; the send time travels in the chunk). Each point is preceded\n"
        "by its own raw round-trip reference (500 round trips as in section 1, just\n"
        "before), so both see the machine in the same state. **Added** is the pipeline's\n"
        "p50 (p99) minus that reference's p50 (p99): what fences, leases, ordering, the Lua\n"
        "scripts, encoding and the product's event loops add over bare Redis (a small\n"
        "negative value is noise between the two measurements). A point is *served* when\n"
        "nothing is lost, at least 95% of the\n"
        "offered events/s are delivered and at most 1% of the sends started more than a\n"
        "chunk (40 ms) late. A served point is run several times, each run after its own\n"
        "reference; the row is the run with the median added p99, and the last column gives\n"
        "every run's (on a shared machine one stall moves one run). The benchmark's own\n"
        "records (which chunks came back, each latency) are kept where the garbage\n"
        "collector does not walk them, and its end-of-run check for lost chunks counts\n"
        "per session: held as 60,000 Python objects, they made the timing process's\n"
        "full collections pause 8 ms, and that pause was counted as the pipeline's.\n"
    )
    ref = s.get("reference_round_trip", {})
    rows = []
    for p in s["points"]:
        if "error" in p:
            rows.append([f(p["sessions"]), f(p["offered_eps"], 0), "-", "-", "-", "-", "-", "-",
                         "-", "-", "-", "**no**", f"failed: {p['error']}", "-"])  # fmt: skip
            continue
        undelivered = p.get("undelivered_at_cutoff", 0)
        lost = f(p["lost"]) + (f" ({undelivered:,} queued at cut-off)" if undelivered else "")
        rows.append([
            f(p["sessions"]), f(p["offered_eps"], 0), f(p["delivered_eps"], 0),
            f(p["latency"]["p50_ms"]), f(p["latency"]["p99_ms"]),
            ms_pair(p.get("reference_round_trip", ref)).removesuffix(" ms"),
            f(p["added_p50_ms"]), f(p["added_p99_ms"]), x(p["ratio_p50"]), x(p["ratio_p99"]),
            lost, "yes" if p["served"] else "**no**", cpu_us(p.get("cpu_us_per_event")),
            f(p.get("sessions_taken_s")),
            ", ".join(f(v) for v in p.get("runs_added_p99_ms", [p["added_p99_ms"]])),
        ])  # fmt: skip
    out.append(table(
        ["sessions", "offered ev/s", "delivered ev/s", "p50 ms", "p99 ms",
         "raw RTT p50 / p99 ms", "added p50 ms", "added p99 ms", "p50 ratio", "p99 ratio",
         "lost", "served", "CPU us per event", "sessions taken in s",
         "added p99 ms of each run"], rows))  # fmt: skip
    for p in (p for p in s["points"] if not p["served"] and "error" not in p):
        out.append(
            f"\nAt {p['sessions']:,} sessions the offered {p['offered_eps']:,.0f} events/s were "
            f"not served: {p['delivered_eps']:,.0f} events/s were delivered and "
            f"{p['late_slots']:,} sends started more than 40 ms late, so the latency there is "
            "queueing, not the pipeline's cost per hop."
        )
    out.append(
        "\n*Sessions taken in* is how long the worker took, after every session's first\n"
        "chunk was sent, to own all of them and echo that chunk (not part of the latency).\n"
        "CPU per event is each process's CPU time over the run divided by the events sent;\n"
        "at low rates it is dominated by fixed background work (heartbeats every 750 ms,\n"
        "blocking-read loops), so compare it between points of similar rate."
    )
    out.append("\nSection 7 gives the most sessions served within the latency budget.")
    return "\n".join(out)


def throughput_section(s: dict[str, Any] | None) -> str:
    out = ["## 3. Throughput to saturation", ""]
    if (msg := failed("throughput", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    first = s["points"][0] if s["points"] else {}
    workers = ", ".join(str(p["workers"]) for p in s["points"]) or "-"
    out.append(
        f"The client sends 40 ms chunks over {first.get('sessions', '-')} sessions as fast as "
        f"their echoes come back ({first.get('window', '-')} events in flight at most, one\n"
        "sender per session: a session's appends are taken one at a time)\n"
        f"through one coordinator and {workers} echo worker processes. Events/s are\n"
        "deliveries per second once warm. References: the raw Python streams of section 1,\n"
        "measured in the same run. The batched stream is the limit (64 messages per command\n"
        "round on every side); the unbatched one (one command per message everywhere) is\n"
        "not a bound: the pipeline batches where it can (a worker's read returns every new\n"
        "entry of every session it follows, the output reader likewise) and can beat it.\n"
    )
    rows = [[
        f(p["workers"]), f(p["events_per_s"], 0), f(s["reference_unbatched_eps"], 0),
        x(p["ratio_to_raw_unbatched"]), f(s["reference_batched_eps"], 0),
        x(p["ratio_to_raw_batched"]), f(p["latency_at_saturation"]["p50_ms"], 1),
        f(p["latency_at_saturation"]["p99_ms"], 1), f(p.get("lost")),
        cpu_us(p.get("cpu_us_per_event")),
        ", ".join(f"{k} {v:.0f}%" for k, v in p.get("cpu_percent", {}).items()),
    ] for p in s["points"]]  # fmt: skip
    out.append(table(
        ["workers", "pipeline ev/s", "raw unbatched ev/s", "ratio", "raw batched ev/s",
         "ratio", "p50 ms", "p99 ms", "lost", "CPU us per event",
         "CPU (% of one core)"], rows))  # fmt: skip
    out.append(
        "\nEach pipeline event costs one run of the append script (the session authority;\n"
        "the appends of one round go in one script call, `dataplane.batching`), a share of a\n"
        "blocking read and of a publish run in the worker, and a share of a read in the\n"
        "output reader: more Redis and Python work than one raw message. CPU microseconds\n"
        "per event, against the raw streams' in section 1, say what an event costs\n"
        "whatever else runs on the machine; the CPU % column shows which process ran out\n"
        "first. When the processes' sum reaches the machine's cores, more worker processes\n"
        "cannot raise the rate: they add contention."
    )
    if (pairs := s.get("paired", {})).get("pairs"):
        median = pairs["median"]
        listed = "; ".join(
            f"{f(p['raw_batched_eps'], 0)} / {f(p['events_per_s'], 0)} ev/s = {x(p['ratio'])}"
            for p in pairs["pairs"]
        )
        out.append(
            f"\n**Side by side.** The raw batched stream's rate moves between runs more than the\n"
            f"pipeline's, so the one-worker ratio is also measured in {len(pairs['pairs'])} pairs, "
            "each saturation\npoint between a raw run just before it and one just after "
            "(their mean is its reference): "
            f"**{x(median['ratio'])}** (the median pair).\nEach pair, raw / pipeline: {listed}.\n"
        )
    per_worker = per_worker_rows(s["points"])
    if per_worker:
        out.append(
            "\nPer worker process, and what the same CPU per event gives on a bigger machine:\n"
            f"{CORES} cores shared by every process, Redis (one thread) capped at one core. On\n"
            "2 cores the sum cannot grow with workers; what says whether adding workers adds\n"
            "capacity where there are cores for them is the cost per event of a worker added\n"
            "with its sessions (the next table). Where the projection is Redis's one core, more\n"
            "is a Redis Cluster's work (section 10).\n"
        )
        out.append(table(
            ["workers", "ev/s per worker", "CPU per event", "in workers", "in Redis",
             f"projected on {CORES} cores"], per_worker))  # fmt: skip
    if scaled := s.get("scaled_out"):
        out.append(
            "\n**Adding workers with their sessions** (`bench/scaleout.py`). Above, one fixed\n"
            "set of sessions is split between more workers: each gets a smaller share of the\n"
            "rate, its rounds carry fewer events, and the fixed cost of a round (a wake-up, a\n"
            "read, a publish) is paid by fewer events. Scaling out is adding a worker *with*\n"
            f"load: here every worker serves {scaled[0]['sessions']} paced sessions (25 chunks/s "
            "each, as in\nsection 2), so every worker runs at the same rate whatever their number, "
            "and CPU\nper event is every process's CPU time (coordinator and client, Redis, all "
            "workers)\nper event sent. At 25 events/s a session, much of that is fixed work "
            "(heartbeats,\nblocking reads, the coordinator's loops) that more events share, so "
            "the figure\nfalls as workers and their sessions are added; what matters is that it "
            "does not\ngrow.\n"
        )
        out.append(table(scaleout.HEADER, scaleout.rows(scaled)))
    return "\n".join(out)


def bargein_section(s: dict[str, Any] | None) -> str:
    out = ["## 4. Barge-in", ""]
    if (msg := failed("bargein", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "A long response is streaming (echo: 64 chunks 20 ms apart; vLLM: up to 400\n"
        "tokens of the tiny local Qwen2 model on CPU); once the client has 5 outputs the\n"
        "benchmark calls `Coordinator.cancel` and times, from that call: (a) the\n"
        "acknowledgement (`cancel` returns: epoch bumped, cancel queued ahead of data,\n"
        "reader moved on), (b) the worker stopping the old epoch's work: the backend's\n"
        "`handle` for it ending, reported by a worker process whose backend is wrapped to\n"
        "write the moment (`bench/traced_worker.py`), and its `release` returning (vLLM:\n"
        "the request aborted in the engine). Every output delivered after (a) is checked;\n"
        "one of the old epoch would be stale. The reference is the raw round trip (a cancel\n"
        "is one write and one hop to the worker) and the backend's own step: the mean\n"
        "interval between the response's outputs before the cancel (p50 over trials).\n"
    )
    ref = s.get("reference_round_trip", {})
    rows = []
    for name in ("echo", "vllm"):
        part = s.get(name, {})
        if not part.get("measured"):
            rows.append([name, "-", "-", "-", "-", "-", f"not measured: {part.get('reason', '-')}"])
            continue
        step = part.get("output_interval", {}).get("p50_ms")
        rows.append([
            name, f"{f(part['ack']['p50_ms'])} / {f(part['ack']['p99_ms'])}",
            f"{f(part['worker_stopped']['p50_ms'])} / {f(part['worker_stopped']['p99_ms'])}",
            f"{f(part['release_returned']['p50_ms'])} / {f(part['release_returned']['p99_ms'])}",
            f"{f(ref.get('p50_ms'), 3)} / {f(ref.get('p99_ms'), 3)}"
            + (f"; step {f(step)} ms" if step else ""),
            f"{x(part['ack']['p50_ms'] / ref['p50_ms'] if ref.get('p50_ms') else math.nan)}",
            f"**{part['stale_outputs_delivered']}** stale of {part['trials']} trials",
        ])  # fmt: skip
    out.append(table(
        ["stage", "(a) ack p50 / p99 ms", "(b) worker stopped p50 / p99 ms",
         "release returned p50 / p99 ms", "reference: raw RTT p50 / p99 ms", "ack p50 ratio",
         "stale outputs delivered"], rows))  # fmt: skip
    return "\n".join(out)


def failover_section(s: dict[str, Any] | None) -> str:
    out = ["## 5. Failover", ""]
    if (msg := failed("failover", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        "One echo worker process owns the sessions, a second one (the heir) has spare\n"
        "capacity, and every session streams chunks at 25/s throughout. The owner is\n"
        "killed with SIGKILL; per session, the time is from the kill to the first output of\n"
        "the new incarnation delivered to the client. Heartbeats every TTL/4, orphan scan\n"
        f"every {s.get('orphan_scan_ms', 100)} ms. Inputs lost: accepted inputs whose echo was "
        "never delivered. The reference is the lease TTL: how long the design waits before "
        "presuming an owner dead.\n"
    )
    rows = [[
        f(r["lease_ttl_ms"]), f(r["failover"]["p50_ms"], 0), f(r["failover"]["p99_ms"], 0),
        f(r["failover"]["max_ms"], 0), x(r["ratio_p50_to_ttl"]), x(r["ratio_max_to_ttl"]),
        f"{r['sessions_moved']}/{r['sessions']}", f(r["inputs_sent"]),
        f"**{r['inputs_lost']}**", f(r["inputs_answered_twice"]),
    ] for r in s["rows"]]  # fmt: skip
    out.append(table(
        ["lease TTL ms", "failover p50 ms", "p99 ms", "max ms", "p50 / TTL", "max / TTL",
         "sessions moved", "inputs sent", "inputs lost", "answered twice"], rows))  # fmt: skip
    out.append(
        "\nA killed owner's lease was last renewed up to TTL/4 before the kill, so the\n"
        "sessions can move from 0.75 x TTL on; the orphan scan, the takeover script, the\n"
        "rebuild from the session log and the next event's round trip come on top."
    )
    return "\n".join(out)


def backlog_section(s: dict[str, Any] | None) -> str:
    out = ["## 6. Backlog and replay", ""]
    if (msg := failed("backlog", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    b, r = s["backlog"], s["replay"]
    out.append(
        f"Backlog: with no worker running the coordinator accepts {b['events']:,} chunks over "
        f"{b['sessions']} sessions; then one echo worker process starts and drains them\n"
        "(64 entries per session per read, one publish script per batch). *Drain* counts\n"
        "from the worker's spawn (Python start-up included); *steady* from its first output\n"
        "to its last (server clock). Replay: one recorded session is replayed as fast as\n"
        "possible into a new session with `coordinator.controlplane.replay.replay_session`\n"
        "and the outputs compared with the original's.\n"
    )
    out.append(table(
        ["figure", "events", "seconds", "events/s", "reference events/s", "ratio"],
        [
            ["coordinator accepts (no worker), 64 appends in flight", f(b["events"]),
             f(b["accept_seconds"]), f(b["accept_events_per_s"], 0),
             f"{f(b.get('accept_reference_eps'), 0)} (Python XADD, 64 in flight)",
             x(b.get("accept_ratio_to_raw_xadd"))],
            ["worker drains the backlog (spawn to last output)", f(b["events"]),
             f(b["drain_seconds"]), f(b["events_per_s"], 0),
             f"{f(b['reference_eps'], 0)} (raw batched)", x(b["ratio_to_raw_batched"])],
            ["worker drains the backlog (steady)", f(b["events"]), "-",
             f(b["steady_events_per_s"], 0), f"{f(b['reference_eps'], 0)} (raw batched)",
             x(b["steady_ratio_to_raw_batched"])],
            [f"replay, fast ({'identical' if r['identical'] else '**different**'} outputs)",
             f(r["inputs"]), f(r["seconds"]), f(r["inputs_per_s"], 0),
             f"{f(r['reference_eps'], 0)} (Python XADD, 1 in flight)",
             x(r.get("ratio_to_raw_xadd"))],
            ["replay, its append phase alone", f(r["inputs"]), "-",
             f(r.get("append_inputs_per_s"), 0),
             f"{f(r['reference_eps'], 0)} (Python XADD, 1 in flight)",
             x(r.get("append_ratio_to_raw_xadd"))],
        ],
    ))  # fmt: skip
    out.append(
        "\nThe replay's time includes reading the source's outputs, appending every input\n"
        "one at a time in order, waiting for the target's outputs (until they match, or\n"
        "3 s without a new one) and comparing them. An append is the session authority's\n"
        "Lua script (fence, seq, log entry) where the reference is a bare XADD."
    )
    return "\n".join(out)


def _again(point: dict[str, Any]) -> str:
    """A re-measured scaling point's first run, shown before the figure that counts."""
    first = point.get("first_run_added_p99_ms")
    return "" if first is None else f"{first:.1f} then "


def scaling_section(s: dict[str, Any] | None) -> str:
    out = ["## 7. Scaling curve", ""]
    if (msg := failed("scaling", s)) is not None:
        return "\n".join([*out, msg])
    assert s is not None
    out.append(
        f"For each number of echo worker processes, paced sessions (25 chunks/s each) are\n"
        f"added step by step until the p99 added latency exceeds {s['budget_ms']:g} ms (over "
        "the raw round trip's p99, measured just before each point as in section 2) or the "
        "point is not served (section 2's rule); the figure is the most sessions served "
        "within the budget. Worker capacity is sessions / workers, so each worker owns an "
        "equal share. A point over budget is measured a second time and counts as over only "
        "if that run is over too (one stall of the machine puts a few events over budget "
        "in one run); the table then shows both.\n"
    )
    rows = []
    for row in s["curve"]:
        tried = ", ".join(
            f"{p['sessions']}: failed ({p['error']})" if "error" in p else
            f"{p['sessions']}: {_again(p)}{p['added_p99_ms']:.1f} ms"
            f"{'' if p['within_budget'] else ' (over)'}"
            for p in row["points"]
        )  # fmt: skip
        note = " (largest tried)" if row.get("ceiling_not_reached") else ""
        rows.append([f(row["workers"]), f"{row['sessions_within_budget']:,}{note}",
                     f(row["events_per_s_within_budget"], 0), x(row["ratio_to_one_worker"]),
                     tried])  # fmt: skip
    out.append(table(["workers", "sessions within budget", "events/s", "vs 1 worker",
                      "sessions tried: p99 added"], rows))  # fmt: skip
    out.append(
        "\nOn a machine with fewer cores than processes (client + coordinator, Redis and the\n"
        "workers), adding workers adds contention rather than capacity; the curve is the\n"
        "shape to compare between machines, and the same command reproduces it on a larger one."
    )
    return "\n".join(out)


def gpu_section() -> str:
    out = [
        "## 8. vLLM time to first token on a GPU (`bench/gpu.sh`)",
        "",
        "`bench/gpu.sh` measures a `vllm` stage's time to first token through the pipeline\n"
        "(coordinator -> vLLM worker -> output reader) against the same engine called\n"
        "directly, on a small Qwen2-architecture model it builds locally (no download). It\n"
        "needs a CUDA machine with vLLM installed (it installs `.[gpu]` only when vLLM is\n"
        "missing, which needs pip to reach an index or a wheel directory), runs offline,\n"
        "and takes under 8 minutes. It writes `bench/gpu-results.json`, which this page\n"
        "shows once present.\n",
    ]
    if not GPU_RESULTS.exists():
        out.append("_Not measured yet: no GPU machine was available when this page was made._")
        return "\n".join(out)
    g = json.loads(GPU_RESULTS.read_text())
    out.append(table(
        ["path", "TTFT p50 ms", "TTFT p99 ms", "samples"],
        [["engine directly", f(g["direct"]["p50_ms"]), f(g["direct"]["p99_ms"]),
          f(g["direct"]["count"])],
         ["through the pipeline", f(g["pipeline"]["p50_ms"]), f(g["pipeline"]["p99_ms"]),
          f(g["pipeline"]["count"])]],
    ))  # fmt: skip
    out.append(
        f"\nRatio pipeline / direct: p50 {x(g.get('ratio_p50'))}, p99 {x(g.get('ratio_p99'))}; "
        f"added p50 {f(g.get('added_p50_ms'))} ms. Device: {g.get('device', '-')}; "
        f"vLLM {g.get('vllm', '-')}; measured {g.get('at', '-')}."
    )
    return "\n".join(out)
