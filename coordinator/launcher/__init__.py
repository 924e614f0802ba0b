"""The launcher: the ``duplexq`` command line and the stacks it starts.

It owns the commands (``cli``; ``control_cli`` for ``duplexq control``, ``replay_cli``
for ``duplexq replay``), ``duplexq up``'s local stack of processes (``local_stack``) and
how commands find a running stack (``stack_state``). It builds on the realtime API
(``coordinator``) and the control plane (``coordinator.controlplane``), and starts
stage workers as processes of their own (``python -m workers``), never importing them.
"""
