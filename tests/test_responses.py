"""The response life table of ``coordinator.responses``, row by row (pure)."""

from __future__ import annotations

import pytest

from coordinator.response_requests import Create
from coordinator.responses import Created, Ended, Item, ResponseLife, TurnState
from schemas.errors import ErrorCode, ProtocolError
from schemas.fence import Fence


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


# -- a connection's part: TurnState ---------------------------------------------------------


def done(response_seq: int) -> dict:
    return {"type": "response.done", "duplexq": {"fence": {"response_seq": response_seq}}}


def test_a_commit_is_taken_only_with_input_since_the_last_commit_or_clear():
    turns = TurnState()
    with pytest.raises(ProtocolError) as refused:
        turns.check_commit()
    assert refused.value.code is ErrorCode.INPUT_AUDIO_BUFFER_COMMIT_EMPTY
    turns.took_input()
    turns.check_commit()
    turns.committed()
    with pytest.raises(ProtocolError):
        turns.check_commit()
    turns.took_input()
    turns.cleared()
    with pytest.raises(ProtocolError):
        turns.check_commit()
    # What the old socket sent may wait for its commit: a resumed connection takes one.
    turns.resumed()
    turns.check_commit()


def test_a_reserved_response_is_in_progress_until_seen_to_end_or_cancelled():
    turns = TurnState()
    assert not turns.unended(0)
    assert turns.unended(1)  # reserved, no end seen (a resumed connection: every one)
    turns.sent({"type": "response.output_text.delta"})
    assert turns.unended(1)
    turns.sent(done(1))
    assert not turns.unended(1) and turns.unended(2)
    turns.cancelled(Fence("s", epoch=3, response_seq=2))
    assert not turns.unended(2)
    assert turns.min_epoch == 3
    # Ends and cancels only ever move it on.
    turns.sent(done(1))
    turns.cancelled(Fence("s", epoch=1, response_seq=1))
    assert (turns.min_epoch, turns.ended_up_to) == (3, 2)


def test_a_create_claims_the_commits_response_or_is_refused_while_its_own_runs():
    turns = TurnState()
    turns.took_input()
    turns.committed()
    turns.requests.committed("resp_0_0_1")
    assert turns.create() is Create.CLAIM
    turns.requests.asked(2)
    with pytest.raises(ProtocolError) as refused:
        turns.create()
    assert refused.value.code is ErrorCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE
    turns.cancelled(Fence("s", epoch=1, response_seq=2))  # a cancel ends it
    assert turns.create() is Create.NEW
