"""The response life table of ``coordinator.responses``, row by row (pure)."""

from __future__ import annotations

import pytest

from coordinator.responses import Created, Ended, Item, ResponseLife


def life(active: str | None) -> ResponseLife:
    responses = ResponseLife()
    responses.active = active
    return responses


@pytest.mark.parametrize(
    ("active", "item", "rid", "changes", "after"),
    [
        (None, Item.OUTPUT, "r1", [Created("r1")], "r1"),
        (None, Item.FINAL_DONE, "r1", [Created("r1"), Ended("r1", "completed")], None),
        ("r1", Item.OUTPUT, "r1", [], "r1"),
        ("r1", Item.OUTPUT, "r2",
         [Ended("r1", "incomplete", "superseded"), Created("r2")], "r2"),
        ("r1", Item.FINAL_DONE, "r1", [Ended("r1", "completed")], None),
        ("r1", Item.CANCEL, None, [Ended("r1", "cancelled", "barge_in")], None),
        ("r1", Item.CLOSE, None, [Ended("r1", "incomplete", "session_closed")], None),
        (None, Item.CANCEL, None, [], None),
        (None, Item.CLOSE, None, [], None),
        (None, Item.REQUEST, "r1", [Created("r1")], "r1"),
        ("r1", Item.REQUEST, "r1", [], "r1"),
        ("resp_0_1_2", Item.OUTPUT, "resp_0_0_1", [], "resp_0_1_2"),
        ("resp_0_1_2", Item.OUTPUT, "resp_0_2_3",
         [Ended("resp_0_1_2", "incomplete", "superseded"), Created("resp_0_2_3")], "resp_0_2_3"),
        ("r1", Item.REQUEST, "r2", [], "r1"),
    ],
)  # fmt: skip
def test_each_row(active, item, rid, changes, after):
    responses = life(active)
    assert responses.step(item, rid, reason="barge_in") == changes
    assert responses.active == after


def test_every_created_response_ends_exactly_once():
    responses = ResponseLife()
    script = [
        (Item.OUTPUT, "r1"), (Item.OUTPUT, "r1"), (Item.OUTPUT, "r2"), (Item.CANCEL, None),
        (Item.FINAL_DONE, "r3"), (Item.OUTPUT, "r4"), (Item.CLOSE, None),
    ]  # fmt: skip
    changes = [c for item, rid in script for c in responses.step(item, rid)]
    created = [c.response_id for c in changes if isinstance(c, Created)]
    ended = [c.response_id for c in changes if isinstance(c, Ended)]
    assert created == ended == ["r1", "r2", "r3", "r4"]


def test_outputs_and_final_dones_name_their_response():
    with pytest.raises(ValueError, match="belongs to a response"):
        ResponseLife().step(Item.OUTPUT)


@pytest.mark.parametrize(
    ("active", "ended", "rid", "changes", "after"),
    [
        ("r1", None, "r1", [Ended("r1", "failed", "backend_error")], None),
        (None, None, "r1", [Created("r1"), Ended("r1", "failed", "backend_error")], None),
        ("r1", None, "r2", [Ended("r1", "incomplete", "superseded"), Created("r2"),
                            Ended("r2", "failed", "backend_error")], None),
        (None, "r1", "r1", [], None),
    ],
)  # fmt: skip
def test_a_failure_ends_its_response_failed_once(active, ended, rid, changes, after):
    responses = life(active)
    responses.ended = ended
    assert responses.step(Item.FAILURE, rid, reason="backend_error") == changes
    assert responses.active == after


def test_a_request_creates_its_response_once_before_its_outputs():
    """A ``response.create`` taken creates its response at once; its outputs, its end or
    a cancel before any output follow as for any response; a request for the response
    that ended last (a commit's, claimed after its answer) creates nothing."""
    responses = ResponseLife()
    assert responses.step(Item.REQUEST, "r1") == [Created("r1")]
    assert responses.step(Item.OUTPUT, "r1") == []
    assert responses.step(Item.FINAL_DONE, "r1") == [Ended("r1", "completed")]
    assert responses.step(Item.REQUEST, "r1") == []
    assert responses.step(Item.REQUEST, "r2") == [Created("r2")]
    assert responses.step(Item.CANCEL, reason="client_cancelled") == [
        Ended("r2", "cancelled", "client_cancelled")
    ]
    # Asked for while another streams: that one goes on, the asked one begins with its
    # first output (or the streaming one ends with the asked one's final done).
    assert responses.step(Item.OUTPUT, "resp_0_2_3") == [Created("resp_0_2_3")]
    assert responses.step(Item.REQUEST, "resp_0_3_4") == []
    assert responses.step(Item.OUTPUT, "resp_0_2_3") == []
    assert responses.step(Item.OUTPUT, "resp_0_3_4") == [
        Ended("resp_0_2_3", "incomplete", "superseded"),
        Created("resp_0_3_4"),
    ]
