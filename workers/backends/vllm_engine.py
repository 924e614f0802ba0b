"""The engine shell: one vLLM ``AsyncLLM`` per worker process, behind a typed wrapper.

vLLM is imported here and nowhere else in the package, by module name at
first use (``importlib``), so that a worker without vLLM installed can still
import ``workers`` and a type checker does not walk vLLM's (partially typed)
sources. Only the few engine members listed in the protocols below are used.

Start-up: building an ``AsyncLLM`` spawns the engine-core process and loads
the model, which takes tens of seconds (about 25 s for a tiny model on CPU).
It runs in a thread, in a task this object owns, so the worker's event loop
(heartbeats, cancels) keeps running meanwhile; ``start_soon`` begins it
without waiting, ``ready`` waits for it.

Errors: a request the engine refuses or fails becomes ``BackendError`` (the
session goes on); a dead engine becomes ``EngineDead`` (a ``BackendError``
too, but every later request of the process fails the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import importlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast

from schemas.events import SettingsPayload
from workers.backends.base import BackendError
from workers.backends.model_source import resolve_model
from workers.backends.vllm_history import ChatMessages
from workers.backends.vllm_options import VllmOptions
from workers.backends.vllm_tools import (
    describe,
    plain_history,
    template_renders_tools,
    with_system_note,
)

log = logging.getLogger("duplexq.worker.vllm")

SHUTDOWN_TIMEOUT_S = 30.0
"""How long the engine process may take to exit before it is killed (it takes ~5 s)."""


class EngineDead(BackendError):
    """The engine process died; nothing more can be generated in this worker."""


class EngineStep(NamedTuple):
    """One streamed step of a request: new text and tokens, and why it ended."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    """``stop``, ``length`` or ``abort`` on the last step, else None."""


class _Completion(Protocol):
    text: str
    token_ids: Sequence[int]
    finish_reason: str | None


class _RequestOutput(Protocol):
    outputs: Sequence[_Completion]
    finished: bool


class _Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class _AsyncLLM(Protocol):
    output_processor: Any

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str
    ) -> AsyncIterator[_RequestOutput]: ...

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None: ...

    def get_tokenizer(self) -> Any: ...

    def get_num_unfinished_requests(self) -> int: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


class SamplingSpec(NamedTuple):
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    json_schema: dict[str, Any] | None = None
    """Constrain the output to JSON of this schema (a forced function call)."""


def response_max_tokens(options: VllmOptions, settings: SettingsPayload) -> int:
    """The most tokens one response generates: the stage's ``max_tokens``, or less where
    the session's ``max_output_tokens`` asks for less."""
    if settings.max_output_tokens is None:
        return options.max_tokens
    return min(options.max_tokens, settings.max_output_tokens)


def request_seed(request_id: str) -> int:
    """The sampling seed of one engine request when the stage fixes none, drawn from the
    request's id (which names its session and fence and counts the worker's requests):
    no two requests share a sample. A seedless engine draws from one generator seeded
    at start, so every fresh stack's first answer to a question was the same."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


def sampling_spec(
    options: VllmOptions, settings: SettingsPayload, request_id: str, max_tokens: int,
    json_schema: dict[str, Any] | None = None,
) -> SamplingSpec:  # fmt: skip
    """How one request samples: the stage's options with the stage's ``seed``, or the
    request's own (``request_seed``); or greedily (temperature 0, the whole
    distribution) when the session asks for it (``SettingsPayload.greedy``, a greedy
    replay): then the same history gives the same answer."""
    seed = options.seed if options.seed is not None else request_seed(request_id)
    if settings.greedy:
        return SamplingSpec(max_tokens, 0.0, 1.0, seed, json_schema)
    return SamplingSpec(max_tokens, options.temperature, options.top_p, seed, json_schema)


def _vllm(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendError(
            "the vllm backend needs vLLM: install the 'cpu' or 'gpu' extra (see DEVELOPERS.md)"
        ) from exc


class VllmEngine:
    """A lazily started ``AsyncLLM`` and its tokenizer."""

    def __init__(self, options: VllmOptions) -> None:
        self.options = options
        self._llm: _AsyncLLM | None = None
        self._tokenizer: _Tokenizer | None = None
        self._starting: asyncio.Future[None] | None = None
        self._built: list[Any] = []
        self.start_s: float | None = None
        """Seconds the engine took to start."""
        self.fallback = False
        """Whether the engine serves the tiny fallback model (see model_source)."""

    # -- lifecycle ---------------------------------------------------------------

    def _build(self) -> None:
        """Create the engine (blocking; runs in a thread).

        The engine is handed over through ``self._built`` rather than returned,
        so that no frame or future of the thread pool keeps it alive after
        ``shutdown`` (vLLM leaves this frame reachable).
        """
        kwargs = self.options.engine_kwargs()
        kwargs["model"], self.fallback = resolve_model(
            self.options.model, self.options.fallback_model_dir
        )
        if self.fallback:
            kwargs.pop("tokenizer", None)  # the tiny model brings its own
        engine_args = _vllm("vllm.engine.arg_utils").AsyncEngineArgs(**kwargs)
        async_llm = _vllm("vllm.v1.engine.async_llm").AsyncLLM
        self._built.append(async_llm.from_engine_args(engine_args))

    def start_soon(self) -> None:
        """Begin starting the engine in the background (no-op once begun)."""
        if self._starting is None and self._llm is None:
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def start() -> None:
                await asyncio.to_thread(self._build)
                self.start_s = loop.time() - started
                log.info("vLLM engine for %s ready in %.1f s", self.options.model, self.start_s)

            self._starting = asyncio.ensure_future(start())

    async def ready(self) -> _AsyncLLM:
        """The engine, started first if need be."""
        if self._llm is not None:
            return self._llm
        self.start_soon()
        assert self._starting is not None
        try:
            # Shielded: a cancelled caller must not orphan a half-built engine.
            await asyncio.shield(self._starting)
        except Exception as exc:
            self._starting = None
            raise BackendError(f"vLLM engine failed to start: {exc}") from exc
        if self._llm is None:
            self._llm = cast(_AsyncLLM, self._built.pop())
            self._tokenizer = cast(_Tokenizer, self._llm.get_tokenizer())
        return self._llm

    async def shutdown(self) -> None:
        """Stop the engine process (waits for a start in progress first)."""
        starting, self._starting = self._starting, None
        if starting is not None:
            with contextlib.suppress(Exception):
                await starting
        if self._llm is None and self._built:
            self._llm = cast(_AsyncLLM, self._built.pop())
        llm, self._llm = self._llm, None
        self._tokenizer = None
        if llm is None:
            return
        # Stop reading outputs first, so that the engine process exiting is not
        # reported as an engine failure.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task):
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        await asyncio.to_thread(llm.shutdown, SHUTDOWN_TIMEOUT_S)
        await asyncio.sleep(0)  # the sockets are closed by a callback on this loop
        # vLLM closes its client sockets but leaves their zmq context to the
        # garbage collector, which then warns; end it here.
        resources = getattr(getattr(llm, "engine_core", None), "resources", None)
        context = getattr(resources, "ctx", None)
        if context is not None and not context.closed:
            context.destroy(linger=0)
        # Collect the engine now: AsyncLLM.__del__ shuts down again, which
        # fails when it only runs at interpreter exit.
        del llm, resources, context
        gc.collect()

    # -- tokenizer -----------------------------------------------------------------

    @property
    def tokenizer(self) -> _Tokenizer:
        if self._tokenizer is None:
            raise BackendError("the vLLM engine is not started")
        return self._tokenizer

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def render(self, chat: ChatMessages, tools: Sequence[dict[str, Any]] = ()) -> str:
        """The prompt text of a chat, ending with the assistant's turn opening; ``tools``
        go to the chat template when it renders tools, else into a system message
        (``vllm_tools``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        kwargs: dict[str, Any] = {}
        if template_renders_tools(template):
            if tools:
                kwargs["tools"] = list(tools)
        else:
            chat = plain_history(chat)
            if tools:
                chat = with_system_note(chat, describe(tools))
        try:
            text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:  # jinja errors, a tokenizer without a template
            raise BackendError(f"cannot apply the chat template: {exc}") from exc
        if not isinstance(text, str):
            raise BackendError("the chat template did not render to text")
        return text

    def encode(self, text: str) -> list[int]:
        # The template already wrote the special tokens out as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, chat: ChatMessages) -> int:
        return len(self.encode(self.render(chat)))

    # -- requests ------------------------------------------------------------------

    def _sampling(self, spec: SamplingSpec) -> Any:
        sampling = _vllm("vllm.sampling_params")
        structured = None
        if spec.json_schema is not None:
            structured = sampling.StructuredOutputsParams(json=spec.json_schema)
        return sampling.SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed,
            skip_special_tokens=True,
            output_kind=sampling.RequestOutputKind.DELTA,
            structured_outputs=structured,
        )

    def parse_calls(self, parser_name: str, text: str, tools: Sequence[dict[str, Any]]) -> Any:
        """vLLM's tool parser ``parser_name`` run over a whole answer: its
        ``ExtractedToolCallInformation`` (``tool_calls``, ``content``)."""
        parsers = _vllm("vllm.tool_parsers")
        protocol = _vllm("vllm.entrypoints.openai.chat_completion.protocol")
        parser = parsers.ToolParserManager.get_tool_parser(parser_name)(self.tokenizer)
        request = protocol.ChatCompletionRequest(
            model=self.options.model, messages=[{"role": "user", "content": ""}],
            tools=list(tools),
        )  # fmt: skip
        return parser.extract_tool_calls(text, request)

    async def generate(
        self, prompt_ids: Sequence[int], spec: SamplingSpec, request_id: str
    ) -> AsyncIterator[EngineStep]:
        """Stream one request; however this ends, the request is gone from the engine."""
        llm = await self.ready()
        exceptions = _vllm("vllm.v1.engine.exceptions")
        stream = llm.generate(
            {"prompt_token_ids": list(prompt_ids)}, self._sampling(spec), request_id
        )
        try:
            async for output in stream:
                completion = output.outputs[0]
                yield EngineStep(
                    completion.text,
                    tuple(completion.token_ids),
                    completion.finish_reason if output.finished else None,
                )
        except exceptions.EngineDeadError as exc:
            raise EngineDead(f"vLLM engine died: {exc}") from exc
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"vLLM request {request_id} failed: {exc!r}") from exc
        finally:
            # vLLM aborts a request whose generate() is cancelled or closed; an
            # early break leaves the stream suspended, so close it, and abort
            # by id whatever is still tracked.
            with contextlib.suppress(Exception):
                await cast(Any, stream).aclose()
            if request_id in self.live_request_ids():
                await self.abort([request_id])

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by the ids they were submitted with."""
        if request_ids and self._llm is not None:
            await self._llm.abort(list(request_ids))

    def live_request_ids(self) -> set[str]:
        """Ids (as submitted) of every request the engine still tracks."""
        if self._llm is None:
            return set()
        states = self._llm.output_processor.request_states
        return {getattr(state, "external_req_id", None) or key for key, state in states.items()}

    def unfinished(self) -> int:
        return 0 if self._llm is None else self._llm.get_num_unfinished_requests()
