"""Read-only views of sessions for operators: list, and one session's details."""

from __future__ import annotations

from dataclasses import dataclass

from dataplane import session_meta
from dataplane.bus import RedisBus
from schemas.config import SESSION_INPUT, PipelineConfig
from schemas.fence import Fence


@dataclass(frozen=True)
class StageView:
    stage: str
    owner: str | None
    applied_seq: int
    lag: int
    """Inputs (or upstream outputs) this stage has not applied yet."""
    owners_so_far: int


@dataclass(frozen=True)
class SessionView:
    session_id: str
    status: str
    fence: Fence
    seq: int
    stages: tuple[StageView, ...]
    lengths: dict[str, int]


async def list_sessions(bus: RedisBus, limit: int = 100) -> list[str]:
    raw = await bus.client.zrange(bus.keys.sessions, 0, limit - 1)
    return [r.decode() for r in raw]


async def inspect_session(bus: RedisBus, pipeline: PipelineConfig, session_id: str) -> SessionView:
    sk = bus.keys.session(session_id)
    meta = await session_meta.snapshot(bus, session_id)
    if meta is None:
        raise KeyError(f"no session {session_id!r}")
    stages = []
    for stage in pipeline.stages:
        lease = await bus.client.get(sk.lease(stage.name))
        applied = meta.applied(stage.name)
        produced = meta.seq if stage.input == SESSION_INPUT else meta.produced(stage.input)
        stages.append(
            StageView(
                stage=stage.name,
                owner=lease.decode().split()[0] if lease else None,
                applied_seq=applied,
                lag=max(0, produced - applied),
                owners_so_far=meta.owners(stage.name),
            )
        )
    lengths = {"input": await bus.client.xlen(sk.input), "client": await bus.client.xlen(sk.client)}
    for stage in pipeline.stages:
        lengths[stage.name] = await bus.client.xlen(sk.stage_out(stage.name))
    return SessionView(session_id, meta.status, meta.fence, meta.seq, tuple(stages), lengths)


def render_session(view: SessionView) -> str:
    lines = [
        f"session {view.session_id}: {view.status}, fence {view.fence}, {view.seq} inputs",
        "  stage        owner                 applied   lag  owners",
    ]
    for st in view.stages:
        lines.append(
            f"  {st.stage:<12} {st.owner or '-':<20} {st.applied_seq:>8} {st.lag:>5} "
            f"{st.owners_so_far:>7}"
        )
    lines.append("  streams: " + ", ".join(f"{k}={v}" for k, v in view.lengths.items()))
    return "\n".join(lines)
