"""The nemesis suite's checker on hand-written histories: each count can fire."""

from __future__ import annotations

from chaos.checker import DEFAULT_BOUND_S, RECOVERY_BOUND_S, Fault, check
from chaos.history import Attempt, History, Op, parse_blocks

A = Attempt(0, 1, 0)
B = Attempt(0, 2, 0)


def history(*ops: Op, client: int = 0) -> History:
    h = History(client)
    for op in ops:
        h.add(op)
    return h


def answered(attempt: Attempt, t: float, epoch: int = 0, blocks=range(4)) -> list[Op]:
    return [Op("block", t + j / 100, attempt, j, epoch) for j in blocks]


def test_blocks_name_themselves():
    blocks, garbled = parse_blocks(A.text()[13:26])
    assert [(b.attempt, b.position) for b in blocks] == [(A, 1)] and not garbled
    assert parse_blocks("<00.0001.0.1>x")[1]


def test_a_clean_history_passes():
    verdict = check([history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.2))])
    assert verdict.ok and sum(verdict.totals.values()) == 0


def test_an_acknowledged_input_never_answered_is_lost():
    verdict = check([history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 1, blocks=[0]))])
    assert verdict.totals["lost"] == 1


def test_an_unacknowledged_attempt_owes_nothing_but_may_not_repeat():
    lenient = check([history(Op("send", 0, A))])
    assert lenient.ok
    twice = check([history(Op("send", 0, A), *answered(A, 1), *answered(A, 2))])
    assert twice.totals["duplicated"] == 4


def test_a_block_after_a_later_cancel_acknowledgement_is_stale():
    ops = [Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.2, blocks=[0])]
    ops += [Op("cancel_sent", 0.3, A), Op("cancelled", 0.4, epoch=1)]
    ops += answered(A, 0.5, epoch=0, blocks=[1])
    verdict = check([history(*ops)])
    assert verdict.totals["stale"] == 1 and verdict.totals["lost"] == 0


def test_order_is_checked_within_and_across_answers():
    ops = [Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.2, blocks=[0, 2, 1, 3])]
    ops += [Op("send", 1, B), Op("ack", 1.1, B), *answered(B, 1.2, blocks=[0])]
    ops += answered(A, 1.3, blocks=[])
    assert check([history(*ops)]).totals["out_of_order"] == 1


def test_dead_and_stalled_sessions_are_counted():
    dead = check([history(Op("dead", 1, detail="resume refused"))])
    assert dead.totals["dead"] == 1
    slow = check([history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 30))], stall_s=20)
    assert slow.totals["stalled"] == 1 and slow.totals["lost"] == 0


def test_recovery_is_the_wait_of_the_clients_a_fault_caught_waiting():
    waiting = history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 3.0))
    idle = history(Op("send", 0, B), Op("ack", 0.1, B), *answered(B, 0.5), client=1)
    verdict = check([waiting, idle], [Fault(1.0, "kill_redis"), Fault(9.0, "kill_worker")])
    assert verdict.recovery == {"kill_redis": [2.0]}
    assert verdict.recovery_summary()["kill_redis"] == {"faults": 1, "p50_s": 2.0, "max_s": 2.0}


def test_a_cancel_ends_every_answer_in_flight_not_only_the_last_sent():
    """An attempt sent again after a dropped socket, whose first try the server had
    accepted after all: a cancel that follows ends both, and neither is lost."""
    retry = Attempt(0, 1, 1)
    ops = [Op("send", 0, A), Op("drop", 0.1), Op("send", 0.2, retry)]
    ops += [Op("ack", 0.3, A), Op("ack", 0.3, retry), *answered(A, 0.4, blocks=[0, 1, 2])]
    ops += [Op("cancel_sent", 0.5, retry), Op("cancelled", 0.6, epoch=1)]
    assert check([history(*ops)]).ok


def test_a_stall_after_a_block_already_on_its_way_is_the_faults_recovery():
    """The fault struck while a block was on its way: it arrives at once, then the
    client waits 4 s. The recovery is the end of that wait, not the first block."""
    ops = [Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.9, blocks=[0])]
    ops += answered(A, 5.0, blocks=[1, 2, 3])
    verdict = check([history(*ops)], [Fault(1.0, "restart_primary")])
    assert [round(t, 3) for t in verdict.recovery["restart_primary"]] == [4.01]


def test_a_client_that_begins_waiting_just_after_the_fault_counts_too():
    """Caught between two inputs, the client sends its next one after the fault and
    waits 3 s for its answer: that wait is the fault's recovery."""
    waiting = history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.2))
    waiting.add(Op("send", 1.2, B))
    for op in answered(B, 4.2):
        waiting.add(op)
    verdict = check([waiting], [Fault(1.0, "kill_worker")])
    assert [round(t, 3) for t in verdict.recovery["kill_worker"]] == [3.2]


def test_a_fault_aimed_at_one_client_is_judged_on_that_client():
    quick = history(Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 1.1))
    stalled = history(Op("send", 0, B), Op("ack", 0.1, B), *answered(B, 8.0), client=1)
    verdict = check([quick, stalled], [Fault(1.0, "drop_socket", "client-0")])
    assert [round(t, 3) for t in verdict.recovery["drop_socket"]] == [0.1]


def test_a_client_idle_when_its_socket_dropped_recovers_with_its_next_answer():
    ops = [Op("send", 0, A), Op("ack", 0.1, A), *answered(A, 0.2), Op("drop", 1.0)]
    ops += [Op("send", 1.05, B), Op("resume", 1.2), Op("ack", 1.25, B), *answered(B, 1.3)]
    verdict = check([history(*ops)], [Fault(1.0, "drop_socket", "client-0")])
    assert [round(t, 3) for t in verdict.recovery["drop_socket"]] == [0.3]


def test_outputs_of_one_owner_at_a_time_pass_and_interleaved_owners_are_found():
    from chaos.owners import handovers, two_owners

    # One stream: owner of incarnation 1, a takeover (2), its seqs restarting; the
    # thinker's outputs in another stream are judged on their own.
    clean = [("s:out", "talker", 1, 1), ("s:out", "talker", 1, 2), ("s:st", "thinker", 1, 9),
             ("s:out", "talker", 2, 1), ("s:out", "talker", 2, 2)]  # fmt: skip
    assert two_owners(clean) == [] and handovers(clean) == 1
    zombie = [*clean, ("s:out", "talker", 1, 3)]  # the old owner's publish landed late
    same_incarnation = [*clean, ("s:out", "talker", 2, 2)]  # two publishers, one seq
    assert two_owners(zombie) == ["s:out talker: inc 1 seq 3 after inc 2 seq 2"]
    assert two_owners(same_incarnation) == ["s:out talker: inc 2 seq 2 after inc 2 seq 2"]


def waits(client: int, until_s: float) -> History:
    """A client that sent at 0 and got its answer at ``until_s``."""
    return history(Op("send", 0, A), Op("ack", 0.05, A), *answered(A, until_s), client=client)


def test_a_class_slower_than_its_bound_is_named_with_its_slowest_recovery():
    slow = DEFAULT_BOUND_S + 1.5
    verdict = check([waits(0, slow), waits(1, 1.5)],
                    [Fault(1.0, "kill_worker"), Fault(1.0, "drop_socket", "client-1")])  # fmt: skip
    assert verdict.over_bound() == {"kill_worker": DEFAULT_BOUND_S + 0.5}


def test_a_fault_overlapped_by_another_is_judged_against_the_larger_bound():
    """A dropped socket whose client then waits on a worker's failover: its recovery
    includes the failover's, so the failover's bound judges it; alone, its own does."""
    drop = RECOVERY_BOUND_S["drop_socket"]
    took = drop + 2.0
    alone = check([waits(0, 1.0 + took)], [Fault(1.0, "drop_socket", "client-0")])
    assert alone.over_bound() == {"drop_socket": took}
    faults = [Fault(1.0, "drop_socket", "client-0"), Fault(1.5, "kill_worker")]
    overlapped = check([waits(0, 1.0 + took)], faults)
    assert overlapped.over_bound() == {}
