"""The nemesis suite: duplexq's guarantees checked under faults, on real processes.

Built as Jepsen builds its tests, in three parts that do not know about each
other:

- the generator (``chaos.client``): WebSocket clients on the realtime API,
  each sending numbered inputs one after another, cancelling some at random
  moments (including right at an answer's end), resuming after every dropped
  socket (also half-open: a new socket before the old one closed). Every
  answer comes back as four self-describing blocks, so each delivered piece
  names its client, input, attempt and position;
- the nemesis (``chaos.nemesis``): every few seconds, one fault among kill -9
  of a worker, SIGSTOP of a worker past its lease then SIGCONT, a worker cut
  off from Redis past its lease with its sockets open, kill -9 of a
  coordinator and a restart, SIGSTOP of a coordinator past its attachment,
  a client's socket dropped, one process's Redis round trips slowed, Redis
  at its memory limit, kill -9 of Redis and a restart on its AOF (on a
  cluster: of a replica; and of a primary, restarted before a failover or
  after its replica's promotion);
- the checker (``chaos.checker``, pure): reads the clients' histories and
  counts, per client, inputs lost, stale pieces delivered after a cancel was
  acknowledged, duplicates, pieces out of order, dead sessions and stalls,
  plus the recovery time of each fault class.

The processes (``chaos.cluster``) run as shipped: a private redis-server with
the product's persistence, two or more coordinators, the control plane, two
or more workers on each stage of a two-stage chain, default settings; each of
them reaches Redis through a TCP proxy of its own (``chaos.proxy``).

``python -m chaos`` runs it (``--help``); ``--ci`` is the short seeded run the
test suite asserts on (``tests/test_nemesis.py``).
"""
