"""The model-extension contract: what the vLLM stage asks of a model family.

A model extension is the pure, model-specific part of a ``vllm`` stage. The
stage shell owns the engine, the streams and the fences; it asks the
extension three questions and carries out the answers:

1. ``configure_sampling_params(defaults, runtime_config)``: once per request,
   one sampling-parameter object per pipeline stage (stage 0 first).
2. ``plan_append(fence, mode, payload, first_append=...)``: for each input
   event, which prompt tokens to append and how many the scheduler must
   reserve (an ``AppendPlan``).
3. ``decide_output(output)``: for each engine output, whether the model is
   speaking, yielding the floor (listen) or has nothing to say yet (a
   ``Decision``).

Extensions are plain objects (no I/O, no asyncio). ``load_extension`` accepts
a built-in name or an object, checks that the entry points exist and wraps it
in ``CheckedExtension``, which verifies every answer's shape, so a faulty
extension fails at the boundary with a clear message instead of deep inside
the engine. Given the stages' sampling defaults, ``load_extension`` also
checks the sampling answer once, so that mistake surfaces at load.

Sampling parameters are generic: with vLLM installed the stage passes
``vllm.SamplingParams``; without it (tests, CPU-only workers) it passes
``StageSamplingParams``. ``copy_sampling_params`` copies either kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, runtime_checkable

from schemas.events import InputMode, Payload
from schemas.fence import Fence, require_fence

SP = TypeVar("SP")

EXTENSION_METHODS = ("configure_sampling_params", "plan_append", "decide_output")
"""Entry points every extension must provide, in the order they are checked."""


def _frozen_mapping(value: Mapping[str, object]) -> Mapping[str, object]:
    """A read-only snapshot of ``value`` (later changes to ``value`` do not leak in)."""
    return MappingProxyType(dict(value))


# --- sampling parameters ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class StageSamplingParams:
    """Sampling settings of one stage when vLLM is not installed.

    Mirrors the ``vllm.SamplingParams`` fields the duplex stages use, with the
    same meanings, so runtime overrides name the same fields either way.
    """

    max_tokens: int = 16
    """Most tokens the stage may generate per request; at least 1."""
    min_tokens: int = 0
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 or -1 disables top-k."""
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        # Lists from JSON/YAML config become tuples so the struct stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def sampling_field_names(params: object) -> frozenset[str] | None:
    """The settable fields of a sampling-parameter object, or None if unknown.

    Dataclasses and msgspec structs (``vllm.SamplingParams`` is one) list their
    fields; for anything else the caller falls back to ``hasattr``.
    """
    if dataclasses.is_dataclass(params):
        return frozenset(f.name for f in dataclasses.fields(params))
    struct_fields = getattr(type(params), "__struct_fields__", None)
    if isinstance(struct_fields, tuple):
        return frozenset(name for name in struct_fields if not name.startswith("_"))
    return None


def copy_sampling_params(params: SP, changes: Mapping[str, Any]) -> SP:
    """A copy of ``params`` with ``changes`` applied; ``params`` is never mutated.

    Dataclasses go through ``dataclasses.replace`` (which re-runs validation);
    objects with ``clone()`` (``vllm.SamplingParams``) are cloned, the fields
    set on the clone and its derived state refreshed. Unknown field names
    raise ValueError.
    """
    known = sampling_field_names(params)
    for name in changes:
        if name.startswith("_") or (known is None and not hasattr(params, name)):
            raise ValueError(f"unknown sampling parameter field {name!r}")
        if known is not None and name not in known:
            raise ValueError(
                f"unknown sampling parameter field {name!r}; known fields: {sorted(known)}"
            )
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.replace(params, **changes)
    clone = getattr(params, "clone", None)
    if not callable(clone):
        raise TypeError(f"cannot copy {type(params).__name__}: neither a dataclass nor has clone()")
    copied: SP = clone()
    for name, value in changes.items():
        setattr(copied, name, value)
    _refresh_derived_state(params, copied, changes)
    return copied


def _refresh_derived_state(original: object, copied: object, changes: Mapping[str, Any]) -> None:
    """Redo what ``vllm.SamplingParams.__post_init__`` derives, which setattr skips.

    - ``_all_stop_token_ids`` (the set min_tokens masking uses) must hold the
      new stop ids instead of the replaced ones (the eos id stays). The set is
      replaced, never updated in place: with ``skip_clone`` the clone is
      shallow and shares it with the default.
    - ``_verify_args`` re-checks value ranges, so a bad override fails here
      (as ValueError) instead of inside the engine.

    Objects without these members (other clone()-able types) are left as is.
    """
    stop_set = getattr(copied, "_all_stop_token_ids", None)
    if "stop_token_ids" in changes and isinstance(stop_set, set):
        # The override replaces the old stop ids; the engine's eos id stays.
        replaced = set(getattr(original, "stop_token_ids", None) or ())
        refreshed = (stop_set - replaced) | set(changes["stop_token_ids"] or ())
        eos = getattr(copied, "_eos_token_id", None)
        if isinstance(eos, int):
            refreshed.add(eos)
        copied._all_stop_token_ids = refreshed  # type: ignore[attr-defined]
    verify = getattr(copied, "_verify_args", None)
    if changes and callable(verify):
        try:
            verify()
        except Exception as exc:
            # vLLM's validation error is not a ValueError in every release;
            # callers of this module only ever see ValueError for bad values.
            raise ValueError(f"invalid sampling parameters: {exc}") from exc


# --- answers ----------------------------------------------------------------
class DecisionAction(StrEnum):
    """What the model is doing after one engine output."""

    LISTEN = "listen"
    """The model yields the floor: stop speaking and wait for user input."""
    SPEAK = "speak"
    """The model produced content for the user."""
    CONTINUE = "continue"
    """Nothing to act on yet (an empty step); keep the request running."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The extension's reading of one engine output. Immutable."""

    action: DecisionAction
    token_ids: tuple[int, ...] = ()
    text: str = ""
    metadata: Mapping[str, object] = field(default_factory=dict)
    """Read-only (a ``MappingProxyType``); extra facts for logs and the shell."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", DecisionAction(self.action))
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))


@dataclass(frozen=True, slots=True)
class RequestBuffer:
    """Per-request bookkeeping of one append, bound to the fence it was planned under.

    ``budget`` is the number of prompt tokens the scheduler reserves for this
    append; ``placeholder_count`` of them stand for multimodal content and
    ``context_reserve`` (first append only) for the system/context prefix.
    """

    fence: Fence
    budget: int
    placeholder_count: int = 0
    context_reserve: int = 0
    first_append: bool = False
    incarnation: int = -1
    """Always the fence's incarnation; filled in when left at -1."""

    def __post_init__(self) -> None:
        require_fence(self.fence)
        if self.incarnation == -1:
            object.__setattr__(self, "incarnation", self.fence.incarnation)
        if self.incarnation != self.fence.incarnation:
            raise ValueError(
                f"buffer incarnation {self.incarnation} does not match fence {self.fence}"
            )
        for name in ("budget", "placeholder_count", "context_reserve"):
            if getattr(self, name) < 0:
                raise ValueError(f"RequestBuffer.{name} must be non-negative")
        if self.placeholder_count + self.context_reserve > self.budget:
            raise ValueError("placeholders and context reserve exceed the budget")
        if self.context_reserve and not self.first_append:
            raise ValueError("a context reserve is only planned on the first append")


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """What to append to the stage-0 prompt for one input event. Immutable.

    ``len(prompt_token_ids)`` always equals ``buffer.budget``: the scheduler
    reserves exactly the tokens the prompt holds.
    """

    mode: InputMode
    prompt_token_ids: tuple[int, ...]
    buffer: RequestBuffer
    metadata: Mapping[str, object] = field(default_factory=dict)
    """Read-only; e.g. ``commit`` for a turn commit, per-modality token counts."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", InputMode(self.mode))
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))
        if len(self.prompt_token_ids) != self.buffer.budget:
            raise ValueError(
                f"prompt has {len(self.prompt_token_ids)} tokens "
                f"but the buffer budgets {self.buffer.budget}"
            )

    @property
    def fence(self) -> Fence:
        return self.buffer.fence


# --- the contract -----------------------------------------------------------
@runtime_checkable
class ModelExtension(Protocol):
    """What a model family provides to the ``vllm`` stage (see the module docstring)."""

    @property
    def name(self) -> str:
        """Short identifier used in logs and metrics."""
        ...

    def configure_sampling_params(
        self, defaults: Sequence[SP], runtime_config: Mapping[str, Any]
    ) -> list[SP]:
        """One sampling-parameter object per stage, as copies of ``defaults``."""
        ...

    def plan_append(
        self,
        fence: Fence,
        mode: InputMode,
        payload: Payload,
        *,
        first_append: bool,
        client_meta: Mapping[str, object] | None = None,
    ) -> AppendPlan:
        """The prompt tokens and budget for one input event.

        ``client_meta`` is whatever extra fields the client attached; an
        extension may read informational keys but must never take a token
        budget from it.
        """
        ...

    def decide_output(
        self,
        output: object,
        *,
        segment_token_ids: Sequence[int] = (),
        segment_metadata: Mapping[str, object] | None = None,
    ) -> Decision:
        """Speak, listen or continue, judged from one engine output.

        ``segment_token_ids`` are the raw tokens streamed so far for the
        current segment (unit) and ``segment_metadata`` what the engine
        attached to them (e.g. ``special_token_ids``); the shell passes them
        when it keeps them, an extension may ignore them.
        """
        ...


# --- loading and checking ---------------------------------------------------
def _require_entry_points(extension: object) -> str:
    """Check the entry points exist and are callable; return the extension's name."""
    for method in EXTENSION_METHODS:
        entry = getattr(extension, method, None)
        if entry is None:
            raise TypeError(
                f"{type(extension).__name__} is not a model extension: missing method {method!r}"
            )
        if not callable(entry):
            raise TypeError(f"{type(extension).__name__}.{method} is not callable")
    name = getattr(extension, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(extension).__name__}.name must be a non-empty string")
    return name


class CheckedExtension:
    """A model extension whose every answer is checked at the boundary.

    - ``configure_sampling_params`` must return a list (or tuple) with exactly
      one item per stage (``ValueError`` otherwise), each an instance of the
      corresponding default's type (``TypeError`` otherwise);
    - ``plan_append`` must return an ``AppendPlan`` (``TypeError``) for the
      fence it was asked about (``ValueError``);
    - ``decide_output`` must return a ``Decision`` (``TypeError``).
    """

    __slots__ = ("_inner", "_name")

    def __init__(self, inner: object) -> None:
        self._name = _require_entry_points(inner)
        self._inner: Any = inner

    @property
    def name(self) -> str:
        return self._name

    @property
    def inner(self) -> object:
        """The wrapped extension (for tests and introspection)."""
        return self._inner

    def configure_sampling_params(
        self, defaults: Sequence[SP], runtime_config: Mapping[str, Any]
    ) -> list[SP]:
        stages = len(defaults)
        # By keyword: an extension may declare these parameters keyword-only.
        result = self._inner.configure_sampling_params(
            defaults=defaults, runtime_config=runtime_config
        )
        if not isinstance(result, list | tuple):
            raise TypeError(
                f"{self._name}.configure_sampling_params must return a list, "
                f"not {type(result).__name__}"
            )
        if len(result) != stages:
            raise ValueError(
                f"{self._name}.configure_sampling_params must return one sampling parameter "
                f"per stage: {stages} stage(s), got {len(result)}"
            )
        for stage, (item, default) in enumerate(zip(result, defaults, strict=True)):
            expected = type(default)
            if not isinstance(item, expected):
                raise TypeError(
                    f"{self._name}.configure_sampling_params returned a "
                    f"{type(item).__name__} for stage {stage}: wrong sampling parameter type, "
                    f"expected {expected.__name__}"
                )
        return list(result)

    def plan_append(
        self,
        fence: Fence,
        mode: InputMode,
        payload: Payload,
        *,
        first_append: bool,
        client_meta: Mapping[str, object] | None = None,
    ) -> AppendPlan:
        require_fence(fence)
        # client_meta is forwarded only when present, so extensions that take
        # no client metadata still load and plan normal events.
        extra: dict[str, object] = {} if client_meta is None else {"client_meta": client_meta}
        plan = self._inner.plan_append(fence, mode, payload, first_append=first_append, **extra)
        if not isinstance(plan, AppendPlan):
            raise TypeError(
                f"{self._name}.plan_append must return an AppendPlan, not {type(plan).__name__}"
            )
        if plan.buffer.fence != fence:
            raise ValueError(
                f"{self._name}.plan_append planned under {plan.buffer.fence}, asked for {fence}"
            )
        return plan

    def decide_output(
        self,
        output: object,
        *,
        segment_token_ids: Sequence[int] = (),
        segment_metadata: Mapping[str, object] | None = None,
    ) -> Decision:
        # The segment arguments are forwarded only when given, so extensions
        # that read the output alone still load and decide.
        extra: dict[str, object] = {}
        if segment_token_ids:
            extra["segment_token_ids"] = tuple(segment_token_ids)
        if segment_metadata:
            extra["segment_metadata"] = segment_metadata
        decision = self._inner.decide_output(output, **extra)
        if not isinstance(decision, Decision):
            raise TypeError(
                f"{self._name}.decide_output must return a Decision, not {type(decision).__name__}"
            )
        return decision


def builtin_extensions() -> Mapping[str, Callable[..., object]]:
    """Built-in extension names and their factories.

    Config names an extension by one of these keys; dotted import paths are
    never accepted, so config cannot make a worker import arbitrary code.
    """
    # Imported here: the built-ins import this module for the contract types.
    from workers.extensions.minicpmo import MiniCPMOExtension

    return MappingProxyType({"minicpmo45": MiniCPMOExtension})


def load_extension(
    obj: object, /, *, sampling_defaults: Sequence[object] | None = None, **options: Any
) -> CheckedExtension:
    """A checked extension from a built-in name, a class or an instance.

    - ``str``: a key of ``builtin_extensions()``, built with ``options``
      (unknown names raise ValueError, dotted paths included);
    - a class: instantiated with ``options``;
    - anything else: used as the extension itself (``options`` must be empty).

    Missing or non-callable entry points raise TypeError naming the method.
    With ``sampling_defaults`` (one default per pipeline stage) the extension
    is also asked once, with an empty runtime config, to configure them, so
    a wrong stage count (ValueError) or sampling type (TypeError) fails when
    the extension loads, not at its first request.
    """
    checked = _build_extension(obj, options)
    if sampling_defaults is not None:
        checked.configure_sampling_params(tuple(sampling_defaults), {})
    return checked


def _build_extension(obj: object, options: Mapping[str, Any]) -> CheckedExtension:
    if isinstance(obj, CheckedExtension):
        if options:
            raise TypeError("options only apply when load_extension builds the extension")
        return obj
    if isinstance(obj, str):
        factories = builtin_extensions()
        factory = factories.get(obj)
        if factory is None:
            raise ValueError(f"unknown model extension {obj!r}; built-in: {sorted(factories)}")
        return CheckedExtension(factory(**options))
    if isinstance(obj, type):
        return CheckedExtension(obj(**options))
    if options:
        raise TypeError("options only apply when load_extension builds the extension")
    return CheckedExtension(obj)
