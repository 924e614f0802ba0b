"""The control plane: the jobs that keep a deployment tidy and safe, and replay.

It owns the arq worker ``duplexq control`` runs (``control``: lease audits, stream
trimming, expiry of closed sessions, replay jobs; ``control_core``: what each job
decides, as pure functions), replaying a session's input log into a new session and
judging the result (``replay``, ``replay_wait``, ``replay_verdict``), and the
operators' read-only views of sessions (``inspect``). It reads and writes Redis
through ``dataplane`` and reads journals with ``coordinator.output_reader``; it serves
no client and imports neither the realtime API nor the launcher nor the workers.
"""
