"""The duplex adapter contract: what a stage model plugs into the runtime.

A *duplex adapter* wraps one model (or a model pipeline) and keeps its state
per session id. The runtime in ``workers.adapters.runtime`` drives it:

- ``on_input(session_id, item)`` feeds one input (text, an audio chunk, a
  video window ...); it only updates state and returns quickly.
- ``should_respond(session_id)`` is a synchronous question asked right after
  input and whenever a proactive adapter signals; ``True`` means "start a
  response now", superseding the response in flight.
- ``respond(session_id)`` returns an async stream of ``OutputChunk``. The
  runtime tags every chunk with its response id and ends a completed response
  with exactly one ``done``. A stream may itself yield ``done`` (its text and
  metadata go on the runtime's ``done``) or ``error`` (the response fails
  there). The runtime may stop iterating at any await: the stream must treat
  cancellation and ``aclose()`` as a normal way to end.
- ``on_barge_in(session_id)`` drops pending work after the runtime has
  cancelled the response in flight.
- ``flush(session_id)`` settles background work before a graceful close (for
  example waits for a pending cognition-gate call) so that ``should_respond``
  reflects everything still to say. The runtime then runs responses until
  ``should_respond`` is false; whatever the adapter had pending is spoken
  through ``respond()`` like any other response, with ids and a ``done``.
- ``on_close(session_id, graceful=...)`` forgets the session.

Proactive adapters (``capabilities.proactive``) also implement
``set_notifier``: the runtime hands them a plain callable to call, from the
event loop thread, when ``should_respond`` may have become true without new
input (a background decision arrived). The runtime re-checks on that signal
when no response is in flight, and after each response that ends on its own;
a wake-up never supersedes a response (only input does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from schemas.events import OutputKind

__all__ = [
    "EMPTY_METADATA",
    "AdapterCapabilities",
    "DuplexAdapter",
    "Notifier",
    "OutputChunk",
    "ProactiveAdapter",
    "freeze_metadata",
]

EMPTY_METADATA: Mapping[str, object] = MappingProxyType({})

Notifier = Callable[[], None]
"""Called by a proactive adapter when its ``should_respond`` may have changed."""


def freeze_metadata(value: Mapping[str, object] | None) -> Mapping[str, object]:
    """A read-only copy of ``value`` (the shared empty mapping for ``None``/empty)."""
    if not value:
        return EMPTY_METADATA
    if not isinstance(value, Mapping):
        raise TypeError(f"metadata must be a mapping, not {type(value).__name__}")
    return MappingProxyType(dict(value))


def _modalities(value: frozenset[str] | set[str] | tuple[str, ...], name: str) -> frozenset[str]:
    if isinstance(value, str):
        # A bare string would silently become a set of its letters.
        raise TypeError(f"{name} must be a collection of modality names, not a string")
    items = frozenset(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name} entries must be non-empty strings, got {item!r}")
    return items


@dataclass(frozen=True, slots=True)
class AdapterCapabilities:
    """What an adapter consumes and produces, and whether it speaks unprompted."""

    input_modalities: frozenset[str]
    output_modalities: frozenset[str]
    proactive: bool = False

    def __post_init__(self) -> None:
        # Accept any collection of names but store frozensets, so instances hash.
        object.__setattr__(
            self, "input_modalities", _modalities(self.input_modalities, "input_modalities")
        )
        object.__setattr__(
            self, "output_modalities", _modalities(self.output_modalities, "output_modalities")
        )
        if not isinstance(self.proactive, bool):
            raise TypeError("proactive must be a bool")


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One piece of a response: a text or audio delta, or a terminal done/error.

    ``response_id`` is 0 until the runtime tags the chunk with the id of the
    response it belongs to; error chunks that belong to no response (a failed
    ``on_input``, say) keep 0. ``metadata`` is stored read-only.
    """

    kind: OutputKind
    text: str = ""
    data: bytes = b""
    metadata: Mapping[str, object] = field(default_factory=lambda: EMPTY_METADATA)
    response_id: int = 0

    def __post_init__(self) -> None:
        # Plain strings ("text_delta") are accepted and normalised to the enum.
        object.__setattr__(self, "kind", OutputKind(self.kind))
        object.__setattr__(self, "metadata", freeze_metadata(self.metadata))
        if not isinstance(self.text, str):
            raise TypeError("OutputChunk.text must be a str")
        if not isinstance(self.data, bytes):
            raise TypeError("OutputChunk.data must be bytes")
        if type(self.response_id) is not int or self.response_id < 0:
            raise ValueError("OutputChunk.response_id must be a non-negative int")

    @property
    def terminal(self) -> bool:
        """Whether this chunk ends a response (``done`` or ``error``)."""
        return self.kind in (OutputKind.DONE, OutputKind.ERROR)

    def tagged(self, response_id: int) -> OutputChunk:
        """This chunk stamped with ``response_id``."""
        if self.response_id == response_id:
            return self
        return dataclasses.replace(self, response_id=response_id)

    @classmethod
    def text_delta(cls, text: str, **metadata: object) -> OutputChunk:
        return cls(OutputKind.TEXT_DELTA, text=text, metadata=metadata)

    @classmethod
    def audio_delta(cls, data: bytes, **metadata: object) -> OutputChunk:
        return cls(OutputKind.AUDIO_DELTA, data=data, metadata=metadata)

    @classmethod
    def done(cls, **metadata: object) -> OutputChunk:
        return cls(OutputKind.DONE, metadata=metadata)

    @classmethod
    def error(cls, message: str, **metadata: object) -> OutputChunk:
        return cls(OutputKind.ERROR, text=message, metadata=metadata)


@runtime_checkable
class DuplexAdapter(Protocol):
    """A model plugged into the duplex runtime; all state is keyed by session id."""

    @property
    def capabilities(self) -> AdapterCapabilities: ...

    async def on_input(self, session_id: str, item: object) -> None:
        """Apply one input to the session's state (no output here)."""

    def should_respond(self, session_id: str) -> bool:
        """Whether a response should start now (superseding one in flight)."""

    def respond(self, session_id: str) -> AsyncIterator[OutputChunk]:
        """Stream one response; called by the runtime inside the response task."""

    async def on_barge_in(self, session_id: str) -> None:
        """Drop pending work; the runtime has already cancelled the response."""

    async def flush(self, session_id: str) -> None:
        """Settle background work before a graceful close (see module docs)."""

    async def on_close(self, session_id: str, *, graceful: bool) -> None:
        """Forget the session; ``graceful`` lets background work finish first."""


@runtime_checkable
class ProactiveAdapter(DuplexAdapter, Protocol):
    """An adapter that can want to speak without new input."""

    def set_notifier(self, session_id: str, notify: Notifier | None) -> None:
        """Install (or with ``None`` remove) the session's wake-up callable."""
