"""Duplex adapters: the contract a stage model implements, and its runtime.

- ``base``: ``DuplexAdapter`` / ``ProactiveAdapter`` protocols,
  ``AdapterCapabilities`` and ``OutputChunk``.
- ``runtime``: ``AdapterRuntime``, which drives one adapter for one session
  (supersede, barge-in, graceful close, proactive wake-ups).
- ``mage_vl`` / ``mage_vl_types``: the proactive video adapter and its data.

Everything here is asyncio only; the Redis shell lives elsewhere.
"""

from workers.adapters.base import (
    AdapterCapabilities,
    DuplexAdapter,
    Notifier,
    OutputChunk,
    ProactiveAdapter,
)
from workers.adapters.mage_vl import GateFn, GenerateFn, MageVLAdapter
from workers.adapters.mage_vl_types import GateDecision, VisualWindow
from workers.adapters.runtime import AdapterRuntime, OutputSink, RuntimeState

__all__ = [
    "AdapterCapabilities",
    "AdapterRuntime",
    "DuplexAdapter",
    "GateDecision",
    "GateFn",
    "GenerateFn",
    "MageVLAdapter",
    "Notifier",
    "OutputChunk",
    "OutputSink",
    "ProactiveAdapter",
    "RuntimeState",
    "VisualWindow",
]
