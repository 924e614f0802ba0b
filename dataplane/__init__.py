"""The data plane both sides of duplexq share: the coordinator and the stage workers
import it, and it imports neither of them.

- ``bus``: every Redis Streams detail (connections, retries, scripts, reads);
- ``scripts``: the server-side Lua that changes a session's fence, leases and streams;
- ``authority``: the session authority on Redis, over those scripts;
- ``session_meta``: the one reader and writer of the session meta hash's fields;
- ``sessions``: the pure fence rule (``fence_mismatch``, ``FenceView``);
- ``stage_fence``: the fence a stage serves, its transitions and the one stale check;
- ``request_ids``: the request-id codec;
- ``metrics`` and ``logs``: Prometheus metrics and structured logs;
- ``config``: settings and pipelines read from files and the environment.
"""
