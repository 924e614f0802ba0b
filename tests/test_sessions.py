import pytest

from dataplane.request_ids import make_request_id
from schemas.errors import (
    FenceMismatchError,
    ResourceExhaustedError,
    SessionClosedError,
    SessionExistsError,
    SessionNotFoundError,
    UnsupportedModeError,
)
from schemas.events import InputMode
from schemas.fence import Fence
from tests.session_model import AppendResult, SessionManager

F0 = Fence("s1")


@pytest.fixture
def manager():
    return SessionManager(max_sessions=4)


def test_open_get_close(manager):
    session = manager.open(F0)
    assert manager.get("s1") is session
    assert "s1" in manager and len(manager) == 1
    assert manager.close(F0) == []
    assert "s1" not in manager
    with pytest.raises(SessionClosedError):
        manager.get("s1")
    with pytest.raises(SessionNotFoundError):
        manager.get("never")


def test_duplicate_open_is_an_error(manager):
    manager.open(F0)
    with pytest.raises(SessionExistsError) as info:
        manager.open(F0.next_incarnation())
    assert info.value.code == "session_exists"


def test_capacity_limit_is_retryable(manager):
    for i in range(4):
        manager.open(Fence(f"s{i}"))
    with pytest.raises(ResourceExhaustedError) as info:
        manager.open(Fence("s9"))
    assert info.value.retryable and info.value.code == "resource_exhausted"
    manager.close(Fence("s0"))
    manager.open(Fence("s9"))


def test_close_with_stale_fence_keeps_session_and_bindings(manager):
    manager.open(F0)
    current = F0.next_epoch()
    manager.accept_fence(current)
    rid = manager.reserve_request(current, "thinker")
    manager.bind_request(current, "thinker", rid)
    with pytest.raises(FenceMismatchError, match="fence mismatch"):
        manager.close(F0)
    assert manager.get("s1").fence == current
    assert manager.bound_requests(current) == [rid]
    assert manager.close(current) == [rid]


def test_reopen_requires_higher_incarnation(manager):
    manager.open(F0)
    manager.close(F0)
    with pytest.raises(FenceMismatchError, match="fence mismatch"):
        manager.open(F0)
    reopened = F0.next_incarnation()
    manager.open(reopened)
    with pytest.raises(FenceMismatchError, match=r"fence mismatch \(incarnation\)"):
        manager.append(F0, InputMode.APPEND_TEXT)
    assert manager.append(reopened, InputMode.APPEND_TEXT) == AppendResult(1, 1, 0)


def test_accept_fence_moves_forward_or_leaves_state(manager):
    manager.open(F0)
    ahead = Fence("s1", 0, 0, 2, 3)
    assert manager.accept_fence(ahead) == ahead
    with pytest.raises(FenceMismatchError):
        manager.accept_fence(Fence("s1", 0, 0, 1, 9))
    assert manager.get("s1").fence == ahead
    later_epoch = Fence("s1", 0, 1, 0, 0)
    assert manager.accept_fence(later_epoch) == later_epoch


def test_fence_argument_type_errors(manager):
    manager.open(F0)
    with pytest.raises(TypeError, match="Fence"):
        manager.accept_fence("s1")
    with pytest.raises(TypeError, match="Fence"):
        manager.append("s1", InputMode.APPEND_TEXT)
    with pytest.raises(TypeError, match="Fence"):
        manager.open("s2")
    with pytest.raises(TypeError, match="Fence"):
        manager.close("s1")
    with pytest.raises(TypeError):
        manager.accept_fence()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        manager.close()  # type: ignore[call-arg]


def test_append_counts_seq_and_turn_seq(manager):
    manager.open(F0)
    got = [manager.append(F0, InputMode.APPEND_AUDIO_CHUNK) for _ in range(3)]
    assert got == [AppendResult(1, 1, 0), AppendResult(2, 2, 0), AppendResult(3, 3, 0)]
    turn1 = F0.next_turn()
    assert manager.append(turn1, InputMode.APPEND_TEXT) == AppendResult(4, 1, 1)
    assert manager.append(turn1, "turn_commit_only") == AppendResult(5, 2, 1)
    # A new epoch restarts the turn-local counter even on the same turn id.
    cancel_to = turn1.next_epoch()
    manager.cancel_fence(turn1, cancel_to)
    assert manager.append(cancel_to, InputMode.APPEND_TEXT) == AppendResult(6, 1, 1)


def test_mode_outside_capabilities_is_not_supported(manager):
    manager.open(F0, capabilities={InputMode.APPEND_TEXT})
    with pytest.raises(ValueError, match="not supported") as info:
        manager.append(F0, InputMode.APPEND_AUDIO_CHUNK)
    assert isinstance(info.value, UnsupportedModeError)
    with pytest.raises(ValueError, match="not supported"):
        manager.append(F0, "append_smell")
    # A refused append consumes no seq.
    assert manager.append(F0, InputMode.APPEND_TEXT).seq == 1


def test_shared_request_is_reported_once_and_release_drops_bindings(manager):
    manager.open(F0)
    rid = manager.reserve_request(F0, "omni")
    manager.bind_request(F0, "thinker", rid)
    manager.bind_request(F0, "talker", rid)
    other = manager.reserve_request(F0, "vad")
    manager.bind_request(F0, "vad", other)
    assert manager.bound_requests(F0) == [rid, other]
    assert manager.release_fence(F0) == [rid, other]
    assert manager.bound_requests(F0) == []
    assert manager.release_fence(F0) == []


def test_bind_refuses_foreign_request(manager):
    manager.open(F0)
    manager.open(Fence("s2"))
    foreign = make_request_id(Fence("s2"), "thinker")
    with pytest.raises(ValueError, match="does not belong"):
        manager.bind_request(F0, "thinker", foreign)
    with pytest.raises(ValueError, match="does not belong"):
        manager.bind_request(F0, "thinker", make_request_id(F0.next_epoch(), "thinker"))


def test_cancel_fence_releases_and_refuses_the_cancelled_fence(manager):
    manager.open(F0)
    rid = manager.reserve_request(F0, "thinker")
    manager.bind_request(F0, "thinker", rid)
    nxt = F0.next_epoch()
    assert manager.cancel_fence(F0, nxt) == [rid]
    assert manager.get("s1").fence == nxt
    with pytest.raises(FenceMismatchError, match=r"fence mismatch \(epoch\)"):
        manager.append(F0, InputMode.APPEND_TEXT)
    assert manager.append(nxt, InputMode.APPEND_TEXT).seq == 1
    assert manager.bound_requests(F0) == []


@pytest.mark.parametrize(
    "bad_next",
    [Fence("s1", 0, 0, 5, 5), Fence("s1", 1, 1), Fence("s2", 0, 1)],
)
def test_cancel_fence_requires_a_higher_epoch_and_changes_nothing(manager, bad_next):
    manager.open(F0)
    rid = manager.reserve_request(F0, "thinker")
    with pytest.raises(FenceMismatchError):
        manager.cancel_fence(F0, bad_next)
    assert manager.get("s1").fence == F0
    assert manager.bound_requests(F0) == [rid]


def test_cancel_with_stale_fence_is_refused(manager):
    manager.open(F0)
    manager.accept_fence(F0.next_epoch())
    with pytest.raises(FenceMismatchError):
        manager.cancel_fence(F0, F0.next_epoch().next_epoch())


def test_close_releases_every_epoch(manager):
    manager.open(F0)
    old = manager.reserve_request(F0, "thinker")
    nxt = F0.next_epoch()
    manager.accept_fence(nxt)
    new = manager.reserve_request(nxt, "thinker")
    manager.bind_request(nxt, "talker", new)
    assert manager.close(nxt) == [old, new]


def test_closed_memory_is_bounded():
    manager = SessionManager(max_sessions=2, closed_memory=2)
    for name in ("a", "b", "c"):
        manager.open(Fence(name))
        manager.close(Fence(name))
    with pytest.raises(SessionNotFoundError):
        manager.get("a")
    with pytest.raises(SessionClosedError):
        manager.get("c")


def test_max_sessions_must_be_positive():
    with pytest.raises(ValueError):
        SessionManager(max_sessions=0)
