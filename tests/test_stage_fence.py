"""The stage fence's transitions and its stale check (pure, no Redis)."""

import pytest

from dataplane.sessions import MismatchReason
from dataplane.stage_fence import StageFence, released
from schemas.fence import Fence
from workers.backends.base import StageContext

F = Fence("s", 1, 2, 3, 4)


@pytest.mark.parametrize(
    ("epoch", "against", "stale"),
    [(1, 2, True), (2, 2, False), (3, 2, False)],
)
def test_released_is_an_epoch_below(epoch, against, stale):
    assert released(F.replace(epoch=epoch), against) is stale
    assert StageFence(F.replace(epoch=against)).is_stale(F.replace(epoch=epoch)) is stale


def test_stale_looks_at_the_epoch_only():
    fence = StageFence(F)
    assert not fence.is_stale(F.replace(turn_id=0, response_seq=0))
    assert not fence.is_stale(F.replace(incarnation=0))
    assert fence.is_stale(F.replace(epoch=1, turn_id=9, response_seq=9))


def test_follow_serves_a_newer_fence_and_ignores_a_regression():
    fence = StageFence(F)
    fence.follow(F.replace(turn_id=5))
    assert fence.current == F.replace(turn_id=5)
    fence.follow(F.replace(turn_id=4))
    assert fence.current == F.replace(turn_id=5)
    # A later epoch wins even with a lower turn.
    fence.follow(F.replace(epoch=3, turn_id=0, response_seq=0))
    assert fence.current == F.replace(epoch=3, turn_id=0, response_seq=0)


def test_follow_takes_a_higher_incarnation_as_ours():
    fence = StageFence(F)
    fence.follow(F.replace(incarnation=2))
    assert fence.current == F.replace(incarnation=2)
    # But not one whose counters regressed against the served fence.
    fence = StageFence(F)
    fence.follow(F.replace(incarnation=2, turn_id=1))
    assert fence.current == F
    # Nor a lower incarnation.
    fence.follow(F.replace(incarnation=0, epoch=9))
    assert fence.current == F


def test_a_cancel_raises_the_epoch_only():
    fence = StageFence(F)
    fence.on_cancel(Fence("s", 1, 5, 7, 8))
    assert fence.current == F.replace(epoch=5)
    fence.on_cancel(Fence("s", 1, 4, 0, 0))  # an older cancel, read late
    assert fence.current == F.replace(epoch=5)


def test_a_cancel_advances_the_upstream_view():
    fence = StageFence(F)
    fence.on_cancel(Fence("s", 0, 5, 0, 0))
    # The epoch floor rose: an upstream output of the old epoch is dropped.
    assert fence.judge_upstream(Fence("s", 0, 2, 3, 4)) is MismatchReason.EPOCH
    assert fence.drop_reason(Fence("s", 0, 2, 3, 4)) == "epoch"
    assert fence.judge_upstream(Fence("s", 0, 5, 0, 0)) is None


def test_a_failover_raises_the_incarnation_and_advances_the_view():
    fence = StageFence(F)
    fence.on_failover(Fence("s", 3, 9, 9, 9))
    assert fence.current == F.replace(incarnation=3)
    # The view's epoch floor moved; its incarnation waits for the failover's barrier.
    assert fence.judge_upstream(Fence("s", 3, 2, 0, 0)) is MismatchReason.EPOCH
    assert fence.upstream.incarnation == 0


def test_a_failover_not_newer_moves_nothing():
    fence = StageFence(F)
    fence.on_failover(Fence("s", 1, 9, 9, 9))
    assert fence.current == F
    assert fence.judge_upstream(Fence("s", 1, 2, 0, 0)) is None


def test_an_interrupt_raises_the_epoch_and_leaves_the_view():
    fence = StageFence(F)
    fence.on_interrupt(Fence("s", 1, 3, 9, 9))
    assert fence.current == F.replace(epoch=3)
    fence.on_interrupt(Fence("s", 1, 1, 0, 0))
    assert fence.current == F.replace(epoch=3)
    assert fence.judge_upstream(Fence("s", 1, 2, 0, 0)) is None  # no floor was set


@pytest.mark.parametrize(
    ("reserved", "served"),
    [
        (Fence("s", 1, 2, 5, 6), Fence("s", 1, 2, 5, 6)),
        (Fence("s", 1, 3, 5, 6), F),  # another epoch: an interruption came between
        (Fence("s", 2, 2, 5, 6), F),  # another incarnation
    ],
)
def test_a_reservation_is_taken_only_in_the_served_epoch(reserved, served):
    fence = StageFence(F)
    fence.on_reserve(reserved)
    assert fence.current == served


def test_a_refused_release_raises_the_epoch_and_the_views_floor_only():
    fence = StageFence(F)
    fence.on_refused_released(Fence("s", 1, 3, 8, 8))
    assert fence.current == F.replace(epoch=3)
    assert fence.judge_upstream(Fence("s", 1, 2, 3, 4)) is MismatchReason.EPOCH
    # The turn the authority reserved since is not taken: older inputs are still owed.
    assert fence.judge_upstream(Fence("s", 1, 3, 0, 0)) is None


def test_a_refused_release_at_a_known_epoch_moves_nothing():
    fence = StageFence(F)
    fence.on_refused_released(Fence("s", 1, 2, 8, 8))
    assert fence.current == F
    assert fence.judge_upstream(Fence("s", 1, 2, 0, 0)) is None


def test_a_refused_incarnation_takes_the_authoritys():
    fence = StageFence(F)
    fence.on_refused_incarnation(Fence("s", 4, 0, 0, 0))
    assert fence.current == F.replace(incarnation=4)


def test_a_refusal_as_ahead_resyncs_to_the_authority():
    fence = StageFence(F.replace(epoch=5))
    fence.on_refused_ahead(F)
    assert fence.current == F
    # The view only ever advances: what it has seen of epoch 5 is not unlearnt.
    assert fence.judge_upstream(F) is MismatchReason.EPOCH


def test_barriers_and_handled_outputs_move_the_upstream_view_only():
    fence = StageFence(F)
    fence.on_barrier(Fence("s", 2, 2, 0, 0))
    assert fence.upstream == Fence("s", 2, 2, 0, 0)
    assert fence.judge_upstream(Fence("s", 2, 2, 1, 1)) is None
    assert fence.upstream == Fence("s", 2, 2, 1, 1)
    assert fence.current == F


def test_a_zombie_output_is_named_by_its_incarnation():
    fence = StageFence(F)
    fence.on_barrier(Fence("s", 2, 2, 0, 0))
    zombie = Fence("s", 1, 2, 9, 9)
    assert fence.judge_upstream(zombie) is MismatchReason.INCARNATION
    assert fence.drop_reason(zombie) == "incarnation"


def test_the_context_reads_the_stage_fence_and_cannot_assign_it():
    ctx = StageContext("s", "stage", F, {})
    ctx.stage_fence.on_interrupt(F.replace(epoch=3))
    assert ctx.fence == F.replace(epoch=3)
    with pytest.raises(AttributeError):
        ctx.fence = F  # type: ignore[misc]
