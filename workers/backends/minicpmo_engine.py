"""The ``minicpmo`` stage's engine shell and what its outputs look like to the extension.

``MiniCPMOEngine`` is the ``vllm`` stage's ``VllmEngine`` (one ``AsyncLLM``
per worker, started in the background, vLLM imported by name at first use)
with one addition: requests take sampling parameters the caller built (the
extension configures them) and, optionally, the prompt's multimodal data
(``MiniCPMOStage.multi_modal_data``; the Mage-VL stage sends its frames the
same way). Each
streamed step keeps its stop reason, which the listen decision may rest on.

``OutputView`` is what ``decide_output`` reads for one step: only that
step's completion (its own token ids, text, stop and finish reasons), never
the prompt, and the special-token metadata naming the listen token.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from workers.backends.base import BackendError
from workers.backends.vllm_engine import EngineDead, VllmEngine, _vllm


class DuplexStep(NamedTuple):
    """One streamed step of a unit's request, as the engine returned it."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    """``stop``, ``length`` or ``abort`` on the last step, else None."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the request, if any."""


class MiniCPMOEngine(VllmEngine):
    """The ``vllm`` stage's engine, taking sampling parameters built by the caller."""

    def sampling_params(self, **fields: Any) -> Any:
        """A ``vllm.SamplingParams`` streaming deltas, one completion per request."""
        sampling = _vllm("vllm.sampling_params")
        return sampling.SamplingParams(
            n=1, output_kind=sampling.RequestOutputKind.DELTA, detokenize=True, **fields
        )

    async def stream(
        self,
        prompt_ids: Sequence[int],
        params: Any,
        request_id: str,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[DuplexStep]:
        """Stream one request; however this ends, the request is gone from the engine."""
        llm = await self.ready()
        exceptions = _vllm("vllm.v1.engine.exceptions")
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        if multi_modal_data:
            prompt["multi_modal_data"] = dict(multi_modal_data)
        # A clone per request: the engine may adjust the object it is given.
        stream = llm.generate(prompt, params.clone(), request_id)
        try:
            async for output in stream:
                completion: Any = output.outputs[0]
                yield DuplexStep(
                    completion.text,
                    tuple(completion.token_ids),
                    completion.finish_reason if output.finished else None,
                    getattr(completion, "stop_reason", None),
                )
        except exceptions.EngineDeadError as exc:
            raise EngineDead(f"vLLM engine died: {exc}") from exc
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"vLLM request {request_id} failed: {exc!r}") from exc
        finally:
            # As in VllmEngine.generate: close a suspended stream, abort what is left.
            with contextlib.suppress(Exception):
                await cast(Any, stream).aclose()
            if request_id in self.live_request_ids():
                await self.abort([request_id])


@dataclass(frozen=True, slots=True)
class CompletionView:
    """One step's completion: only this step's tokens, never the prompt's."""

    token_ids: tuple[int, ...]
    text: str
    stop_reason: int | str | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class OutputView:
    """What ``decide_output`` reads for one step."""

    outputs: tuple[CompletionView, ...]
    special_token_ids: Mapping[str, int]


def token_lookup(tokenizer: Any) -> Callable[[str], int | None]:
    """``convert_tokens_to_ids`` that says None for a token the vocabulary lacks.

    Tokenizers with an unknown token map every missing token to its id; that
    must not pass for, say, a listen token the checkpoint does not have.
    """
    unk_token = getattr(tokenizer, "unk_token", None)
    unk_id = getattr(tokenizer, "unk_token_id", None)

    def lookup(token: str) -> int | None:
        value = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(value, int) or (value == unk_id and token != unk_token):
            return None
        return value

    return lookup
