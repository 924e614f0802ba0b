"""Live sessions, counted per API key and in total, across every coordinator.

A session is *live* from its open until it is closed or its client has been
gone longer than the resume grace: attached sessions count, and so do
detached ones a client may still resume. Redis keeps two sorted sets (one for
the deployment, one per API-key digest; ``schemas.keys``) of session id ->
the time until which it counts, in ms:

- ``admit`` (open) prunes what has stopped counting, refuses the session when
  either set is full (``session_limit``) and adds it, in one script. A resume
  re-adds its session without a check: the session exists, refusing its
  resume would lose it.
- ``renew`` (every third of ``attach_ttl_ms``, with the attachments) pushes
  each attached session's time to ``now + attach_ttl_ms + resume grace`` and
  removes the sessions found closed; ``detached`` sets it to ``now + grace``;
  ``drop`` removes a session closed after its grace.

Nothing has to run for a session to stop counting: a coordinator that dies
stops renewing, and its sessions fall out of the count when the control
plane may close them (their attachment lapsed and the grace ran out), at the
next admission's prune. A session closed by other means (a stage closing a
failed session) stops counting at its coordinator's next renewal, or at the
end of the grace if it had no client.
"""

from __future__ import annotations

from collections.abc import Mapping

from dataplane.bus import RedisBus
from schemas.config import Settings
from schemas.errors import SessionLimitError

# KEYS: all mine    ARGV: sid now_ms until_ms max_total max_mine check(0|1)
# Retried after it ran, it finds the session counted and changes nothing more.
ADMIT = r"""
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
if ARGV[6] == '1' and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return {'total'} end
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return {'key'} end
end
for i = 1, 2 do
  redis.call('ZADD', KEYS[i], ARGV[3], ARGV[1])
  local last = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[i], last[2])
end
return {'ok'}
"""

# KEYS: all mine_1 .. mine_n    ARGV: (op sid until_ms) for each mine_i
# op 'r': the session counts until until_ms; 'd': it no longer counts.
RENEW = r"""
for i = 2, #KEYS do
  local op, sid, until_ms = ARGV[3 * i - 5], ARGV[3 * i - 4], ARGV[3 * i - 3]
  for _, key in ipairs({KEYS[1], KEYS[i]}) do
    if op == 'r' then
      redis.call('ZADD', key, until_ms, sid)
      local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      redis.call('PEXPIREAT', key, last[2])
    else
      redis.call('ZREM', key, sid)
    end
  end
end
return #KEYS - 1
"""


class LiveSessions:
    """The live-session counts of one deployment."""

    def __init__(self, bus: RedisBus, settings: Settings) -> None:
        self.bus = bus
        self.settings = settings
        self.attached_ms = settings.attach_ttl_ms + settings.resume_grace_s * 1000
        """How long an attached session counts past its last renewal."""
        self._admit = bus.register(ADMIT)
        self._renew = bus.register(RENEW)

    async def admit(self, session_id: str, key_digest: str, now_ms: int, *, resume: bool) -> None:
        """Count the session, or raise ``SessionLimitError`` (a new one only)."""
        keys = self.bus.keys
        reply = await self.bus.run(
            self._admit,
            [keys.live_sessions, keys.live_sessions_of(key_digest)],
            [session_id, now_ms, now_ms + self.attached_ms, self.settings.max_sessions_total,
             self.settings.max_sessions_per_key, "0" if resume else "1"],
        )  # fmt: skip
        if reply[0] == "total":
            raise SessionLimitError(
                f"the deployment holds {self.settings.max_sessions_total} live sessions; "
                "retry later"
            )
        if reply[0] == "key":
            raise SessionLimitError(
                f"this API key holds {self.settings.max_sessions_per_key} live sessions "
                "(detached ones count until their resume grace ends); close one or retry later"
            )

    async def renew(
        self, attached: Mapping[str, str], closed: Mapping[str, str], now_ms: int
    ) -> None:
        """``attached`` and ``closed`` map session id -> key digest."""
        ops = [("r", sid, digest, now_ms + self.attached_ms) for sid, digest in attached.items()]
        ops += [("d", sid, digest, 0) for sid, digest in closed.items()]
        await self._apply(ops)

    async def detached(self, session_id: str, key_digest: str, now_ms: int) -> None:
        """The session's client left: it counts for the resume grace from now."""
        until = now_ms + self.settings.resume_grace_s * 1000
        await self._apply([("r", session_id, key_digest, until)])

    async def drop(self, session_id: str, key_digest: str) -> None:
        """The session closed: it counts no more."""
        await self._apply([("d", session_id, key_digest, 0)])

    async def _apply(self, ops: list[tuple[str, str, str, int]]) -> None:
        if not ops:
            return
        keys = self.bus.keys
        script_keys = [keys.live_sessions] + [keys.live_sessions_of(d) for _, _, d, _ in ops]
        args: list[str | int] = []
        for op, sid, _, until in ops:
            args += [op, sid, until]
        await self.bus.run(self._renew, script_keys, args)
