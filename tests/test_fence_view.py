"""The consumer-side fence view and the actor's per-entry decision (pure, no Redis)."""

import pytest

from dataplane.sessions import FenceView, MismatchReason
from dataplane.stage_fence import StageFence
from schemas.events import (
    ControlEvent,
    ControlKind,
    InputEvent,
    InputMode,
    OutputEvent,
    OutputKind,
    TextPayload,
)
from schemas.fence import Fence
from workers.actor import Step, decide

F = Fence("s", 0, 0, 0, 0)


def test_judge_delivers_and_moves_forward():
    view = FenceView(F)
    assert view.judge(Fence("s", 0, 0, 1, 1)) is None
    assert view.current == Fence("s", 0, 0, 1, 1)
    assert view.judge(Fence("s", 0, 0, 0, 1)) is MismatchReason.TURN
    assert view.judge(Fence("other", 0, 0, 5, 5)) is MismatchReason.SESSION


def test_local_cancel_drops_old_epoch_before_the_barrier_is_read():
    view = FenceView(F)
    view.advance(F.next_epoch())
    assert view.judge(F) is MismatchReason.EPOCH
    assert view.judge(F.next_epoch()) is None


def test_failover_incarnation_counts_from_its_barrier():
    view = FenceView(F)
    heir = F.next_incarnation()
    # Out-of-band news of the failover does not reject what the old owner
    # published before the barrier...
    view.advance(heir)
    assert view.judge(F) is None
    # ...but from the barrier on, the old incarnation is a zombie.
    view.observe(heir)
    assert view.judge(F) is MismatchReason.INCARNATION
    assert view.judge(heir) is None


def test_epoch_floor_survives_a_failover():
    view = FenceView(F)
    view.advance(F.next_epoch())  # cancelled locally
    view.observe(Fence("s", 1, 0, 0, 0))  # a failover barrier carrying the older epoch
    assert view.judge(Fence("s", 1, 0, 0, 0)) is MismatchReason.EPOCH
    assert view.judge(Fence("s", 1, 1, 0, 0)) is None


def test_observe_ignores_other_sessions_and_regressions():
    view = FenceView(Fence("s", 0, 3, 0, 0))
    view.observe(Fence("x", 5, 9, 9, 9))
    view.observe(Fence("s", 0, 1, 0, 0))
    assert view.current == Fence("s", 0, 3, 0, 0)


def _input(seq, fence=F):
    return InputEvent(fence, seq, seq, InputMode.APPEND_TEXT, TextPayload("x"))


def _output(seq, fence=F):
    return OutputEvent(fence, "up", OutputKind.TEXT_DELTA, seq)


@pytest.mark.parametrize(
    ("event", "applied", "current", "step"),
    [
        (ControlEvent(ControlKind.CANCEL, F), 0, F, Step.BARRIER),
        (_input(3), 3, F, Step.SKIP),
        (_input(2), 3, F, Step.SKIP),
        (_input(4), 3, F, Step.HANDLE),
        (_input(4), 3, F.next_epoch(), Step.ABSORB),
        (_output(4), 3, F, Step.HANDLE),
        (_output(3), 3, F, Step.SKIP),
        (_output(4, Fence("s", 0, 0, 0, 0)), 3, Fence("s", 0, 1, 0, 0), Step.DROP),
    ],
)
def test_decide(event, applied, current, step):
    assert decide(event, applied, StageFence(current)) is step


def test_a_higher_incarnation_is_a_newer_owner_and_moves_the_view():
    view = FenceView(F)
    heir = Fence("s", 2, 0, 0, 0)
    assert view.judge(heir) is None
    assert view.current == heir
    assert view.judge(F) is MismatchReason.INCARNATION


def test_a_resuming_view_knows_the_epoch_and_learns_the_incarnation():
    view = FenceView.resuming(Fence("s", 3, 2, 5, 7))
    # Published before the failovers that raised the incarnation to 3: delivered.
    assert view.judge(Fence("s", 1, 2, 1, 1)) is None
    # Older epochs stay stale; the incarnation only moves forward from here.
    assert view.judge(Fence("s", 1, 1, 9, 9)) is MismatchReason.EPOCH
    view.observe(Fence("s", 3, 2, 5, 7))
    assert view.judge(Fence("s", 1, 2, 9, 9)) is MismatchReason.INCARNATION
    assert view.judge(Fence("s", 3, 2, 5, 7)) is None
