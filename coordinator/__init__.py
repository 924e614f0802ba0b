"""The coordinator: the client-facing side of duplexq, three programs in one package.

- The realtime API (the modules here): the WebSocket and HTTP server (``app``,
  ``server_options``, ``socket_io``), one connection per client (``connection``), the
  translation between the OpenAI Realtime protocol and duplexq's fenced events
  (``realtime``, ``frames``, ``items``, ``conversation``), a response's life
  (``responses``, ``response_requests``, ``turns``), admission and limits (``admission``,
  ``limits``, ``auth``, ``client_secrets``), attachments and resumes
  (``attachments``, ``resume``) and the facade the connections share (``hub``,
  ``service``).
- The control plane (``coordinator.controlplane``): the jobs of ``duplexq control``,
  replay, and the operators' views of sessions.
- The launcher (``coordinator.launcher``): the ``duplexq`` command line and the local
  stack ``duplexq up`` runs.

The realtime API and the control plane import neither each other nor the launcher;
both read client journals with ``output_reader`` (``tests/test_layout.py``).
"""
