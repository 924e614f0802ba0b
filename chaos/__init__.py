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
  of a worker, SIGSTOP of a worker past its lease then SIGCONT, kill -9 of
  Redis and a restart on its AOF, kill -9 of a coordinator and a restart, a
  client's socket dropped;
- the checker (``chaos.checker``, pure): reads the clients' histories and
  counts, per client, inputs lost, stale pieces delivered after a cancel was
  acknowledged, duplicates, pieces out of order, dead sessions and stalls,
  plus the recovery time of each fault class.

The processes (``chaos.cluster``) run as shipped: a private redis-server with
the product's persistence, two or more coordinators, the control plane, two
or more workers on each stage of a two-stage chain, default settings.

``python -m chaos`` runs it (``--help``); ``--ci`` is the short seeded run the
test suite asserts on (``tests/test_nemesis.py``).
"""
