"""The model-extension contract: value types, sampling copies and the checked loader."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import msgspec
import pytest

from schemas.events import CommitPayload, InputMode, TokensPayload
from schemas.fence import Fence
from workers.extensions import (
    AppendPlan,
    CheckedExtension,
    Decision,
    DecisionAction,
    ModelExtension,
    RequestBuffer,
    StageSamplingParams,
    builtin_extensions,
    copy_sampling_params,
    load_extension,
)
from workers.extensions.base import EXTENSION_METHODS, sampling_field_names
from workers.extensions.minicpmo import MiniCPMOExtension

FENCE = Fence("sess-1", incarnation=3, epoch=2, turn_id=1, response_seq=4)


class FakeExtension:
    """A minimal well-behaved extension; tests break one answer at a time."""

    name = "fake"

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.plan_calls: list[dict[str, Any]] = []

    def configure_sampling_params(self, defaults, runtime_config):
        if "sampling" in self.answers:
            return self.answers["sampling"]
        return [copy_sampling_params(d, {}) for d in defaults]

    def plan_append(self, fence, mode, payload, *, first_append, **kwargs):
        self.plan_calls.append(kwargs)
        if "plan" in self.answers:
            return self.answers["plan"]
        return AppendPlan(mode, (), RequestBuffer(fence=fence, budget=0, first_append=first_append))

    def decide_output(self, output):
        if "decision" in self.answers:
            return self.answers["decision"]
        return Decision(DecisionAction.CONTINUE)


# --- Decision, RequestBuffer, AppendPlan --------------------------------------
def test_decision_is_frozen_with_read_only_metadata():
    source = {"finish_reason": "stop"}
    decision = Decision("listen", [5, 6], "hi", source)
    assert decision.action is DecisionAction.LISTEN
    assert decision.token_ids == (5, 6)
    assert isinstance(decision.metadata, MappingProxyType)
    with pytest.raises(TypeError):
        decision.metadata["x"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.text = "changed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.metadata = {}  # type: ignore[misc]
    # The metadata is a snapshot: changing the source later does not leak in.
    source["finish_reason"] = "length"
    assert decision.metadata["finish_reason"] == "stop"


def test_decision_rejects_unknown_action():
    with pytest.raises(ValueError):
        Decision("shout")  # type: ignore[arg-type]


def test_decision_has_no_instance_dict():
    assert not hasattr(Decision(DecisionAction.SPEAK), "__dict__")


def test_request_buffer_takes_incarnation_from_fence():
    buffer = RequestBuffer(
        fence=FENCE, budget=10, placeholder_count=4, context_reserve=6, first_append=True
    )
    assert buffer.incarnation == 3
    assert buffer.fence is FENCE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 5, "incarnation": 2}, "incarnation"),
        ({"budget": 5, "context_reserve": 2}, "first append"),
        (
            {"budget": 5, "placeholder_count": 4, "context_reserve": 2, "first_append": True},
            "exceed",
        ),
        ({"budget": -1}, "non-negative"),
    ],
)
def test_request_buffer_rejects_inconsistent_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RequestBuffer(fence=FENCE, **kwargs)


def test_request_buffer_requires_a_fence():
    with pytest.raises(TypeError, match="must be a Fence"):
        RequestBuffer(fence="sess-1", budget=0)  # type: ignore[arg-type]


def test_append_plan_is_immutable_and_checks_budget():
    buffer = RequestBuffer(fence=FENCE, budget=2)
    plan = AppendPlan(InputMode.APPEND_TOKENS, [1, 2], buffer, {"k": "v"})
    assert plan.prompt_token_ids == (1, 2)
    assert plan.fence == FENCE
    with pytest.raises(TypeError):
        plan.metadata["k"] = "w"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prompt_token_ids = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="budgets 2"):
        AppendPlan(InputMode.APPEND_TOKENS, (1, 2, 3), buffer)


# --- sampling parameters ------------------------------------------------------
def test_stage_sampling_params_validate_and_freeze_lists():
    params = StageSamplingParams(stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params.stop_token_ids == (1, 2)
    hash(params)
    for bad in ({"max_tokens": 0}, {"top_p": 0.0}, {"temperature": -1.0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            StageSamplingParams(**bad)


def test_copy_sampling_params_dataclass_is_a_new_object():
    default = StageSamplingParams(max_tokens=8)
    copied = copy_sampling_params(default, {"max_tokens": 32, "temperature": 0.0})
    assert copied == StageSamplingParams(max_tokens=32, temperature=0.0)
    assert default.max_tokens == 8
    assert copy_sampling_params(default, {}) == default


@pytest.mark.parametrize("name", ["not_a_field", "_private", "__class__"])
def test_copy_sampling_params_rejects_unknown_fields(name):
    with pytest.raises(ValueError, match="unknown sampling parameter field"):
        copy_sampling_params(StageSamplingParams(), {name: 1})


class CloneableParams(msgspec.Struct, dict=True):
    """Shaped like vllm.SamplingParams: a mutable msgspec struct with clone()."""

    max_tokens: int = 16
    stop_token_ids: list[int] = []
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    _eos_token_id: int | None = None
    verified: int = 0

    def clone(self) -> CloneableParams:
        # Shallow, like vLLM with skip_clone=True: the set is shared.
        return msgspec.structs.replace(self)

    def _verify_args(self) -> None:
        if self.max_tokens < 1:
            raise VendorValidationError("max_tokens must be at least 1")
        self.verified += 1


class VendorValidationError(Exception):
    """A third-party validation error that is not a ValueError (as in vLLM)."""


def test_copy_sampling_params_clone_path_refreshes_derived_state():
    default = CloneableParams(stop_token_ids=[7], _all_stop_token_ids={2, 7}, _eos_token_id=2)
    copied = copy_sampling_params(default, {"max_tokens": 4, "stop_token_ids": [9]})
    assert copied is not default
    assert (copied.max_tokens, copied.stop_token_ids) == (4, [9])
    # The replaced stop id 7 leaves the derived set; the eos id 2 stays.
    assert copied._all_stop_token_ids == {2, 9}
    assert copied.verified == 1
    # The default, and the set it shared with the shallow clone, are untouched.
    assert default.max_tokens == 16
    assert default.stop_token_ids == [7]
    assert default._all_stop_token_ids == {2, 7}
    assert copy_sampling_params(default, {"max_tokens": 5})._all_stop_token_ids == {2, 7}
    with pytest.raises(ValueError, match="invalid sampling parameters: max_tokens must be") as info:
        copy_sampling_params(default, {"max_tokens": 0})
    assert isinstance(info.value.__cause__, VendorValidationError)
    with pytest.raises(ValueError, match="unknown"):
        copy_sampling_params(default, {"_all_stop_token_ids": set()})


def test_sampling_field_names_for_struct_and_unknown_types():
    assert sampling_field_names(CloneableParams()) == {"max_tokens", "stop_token_ids", "verified"}
    assert sampling_field_names(object()) is None


def test_copy_sampling_params_needs_dataclass_or_clone():
    class Plain:
        max_tokens = 3

    with pytest.raises(TypeError, match="clone"):
        copy_sampling_params(Plain(), {"max_tokens": 4})
    with pytest.raises(ValueError, match="unknown"):
        copy_sampling_params(Plain(), {"top_p": 0.5})


# --- loader -------------------------------------------------------------------
@pytest.mark.parametrize("method", EXTENSION_METHODS)
def test_load_rejects_missing_method_by_name(method):
    attrs = {m: (lambda *a, **k: None) for m in EXTENSION_METHODS if m != method}
    broken = type("Broken", (), {"name": "broken", **attrs})()
    with pytest.raises(TypeError, match=method):
        load_extension(broken)


@pytest.mark.parametrize("method", EXTENSION_METHODS)
def test_load_rejects_non_callable_method_by_name(method):
    extension = FakeExtension()
    setattr(extension, method, 42)
    with pytest.raises(TypeError, match=f"{method} is not callable"):
        load_extension(extension)


def test_load_requires_a_name():
    extension = FakeExtension()
    extension.name = ""
    with pytest.raises(TypeError, match="name"):
        load_extension(extension)


def test_load_builtin_by_name_and_refuses_import_paths():
    checked = load_extension("minicpmo45", context_reserve=3)
    assert isinstance(checked, CheckedExtension)
    assert isinstance(checked.inner, MiniCPMOExtension)
    assert checked.inner.context_reserve == 3
    assert checked.name == "minicpmo45"
    assert "minicpmo45" in builtin_extensions()
    for name in ("workers.extensions.minicpmo.MiniCPMOExtension", "os.system", "nope"):
        with pytest.raises(ValueError, match="unknown model extension"):
            load_extension(name)


def test_load_from_class_instance_and_checked():
    from_class = load_extension(FakeExtension)
    assert isinstance(from_class.inner, FakeExtension)
    checked = load_extension(FakeExtension())
    assert load_extension(checked) is checked
    assert isinstance(checked, ModelExtension)
    with pytest.raises(TypeError, match="options"):
        load_extension(FakeExtension(), context_reserve=1)
    with pytest.raises(TypeError, match="options"):
        load_extension(checked, context_reserve=1)


# --- checked answers ----------------------------------------------------------
DEFAULTS = [StageSamplingParams(max_tokens=8), StageSamplingParams(max_tokens=64)]


def test_checked_sampling_passes_good_answers():
    result = load_extension(FakeExtension()).configure_sampling_params(DEFAULTS, {})
    assert result == DEFAULTS
    assert isinstance(result, list)


@pytest.mark.parametrize("answer", [[StageSamplingParams()], DEFAULTS * 2, []])
def test_checked_sampling_requires_one_per_stage(answer):
    checked = load_extension(FakeExtension(sampling=answer))
    with pytest.raises(ValueError, match="one sampling parameter per stage"):
        checked.configure_sampling_params(DEFAULTS, {})


@pytest.mark.parametrize(
    "answer",
    [
        [StageSamplingParams(), {"max_tokens": 8}],
        [None, StageSamplingParams()],
        [CloneableParams(), StageSamplingParams()],
    ],
)
def test_checked_sampling_requires_the_defaults_type(answer):
    checked = load_extension(FakeExtension(sampling=answer))
    with pytest.raises(TypeError, match="expected StageSamplingParams"):
        checked.configure_sampling_params(DEFAULTS, {})


def test_checked_sampling_requires_a_list():
    checked = load_extension(FakeExtension(sampling=(p for p in DEFAULTS)))
    with pytest.raises(TypeError, match="must return a list"):
        checked.configure_sampling_params(DEFAULTS, {})


@pytest.mark.parametrize("answer", [None, {"prompt_token_ids": ()}, Decision("continue")])
def test_checked_plan_append_requires_append_plan(answer):
    checked = load_extension(FakeExtension(plan=answer))
    with pytest.raises(TypeError, match="must return an AppendPlan"):
        checked.plan_append(FENCE, InputMode.TURN_COMMIT_ONLY, CommitPayload(), first_append=False)


def test_checked_plan_append_requires_the_asked_fence():
    other = AppendPlan(
        InputMode.TURN_COMMIT_ONLY, (), RequestBuffer(fence=FENCE.next_epoch(), budget=0)
    )
    checked = load_extension(FakeExtension(plan=other))
    with pytest.raises(ValueError, match="planned under"):
        checked.plan_append(FENCE, InputMode.TURN_COMMIT_ONLY, CommitPayload(), first_append=False)


def test_checked_plan_append_requires_a_fence_argument():
    checked = load_extension(FakeExtension())
    with pytest.raises(TypeError, match="must be a Fence"):
        checked.plan_append(
            "sess-1",  # type: ignore[arg-type]
            InputMode.TURN_COMMIT_ONLY,
            CommitPayload(),
            first_append=False,
        )


def test_checked_plan_append_forwards_client_meta_only_when_given():
    fake = FakeExtension()
    checked = load_extension(fake)
    payload = TokensPayload(token_ids=())
    checked.plan_append(FENCE, InputMode.APPEND_TOKENS, payload, first_append=True)
    checked.plan_append(
        FENCE, InputMode.APPEND_TOKENS, payload, first_append=True, client_meta={"a": 1}
    )
    assert fake.plan_calls == [{}, {"client_meta": {"a": 1}}]


@pytest.mark.parametrize("answer", [None, "listen", DecisionAction.LISTEN])
def test_checked_decide_output_requires_decision(answer):
    checked = load_extension(FakeExtension(decision=answer))
    with pytest.raises(TypeError, match="must return a Decision"):
        checked.decide_output(object())
