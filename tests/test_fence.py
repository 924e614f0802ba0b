import msgspec
import pytest

from dataplane.sessions import MismatchReason, check_fence, fence_mismatch
from schemas.errors import FenceMismatchError
from schemas.fence import Fence, require_fence

CUR = Fence("s1", incarnation=2, epoch=3, turn_id=4, response_seq=5)


def test_fence_is_immutable_slotted_hashable():
    fence = Fence("s1", 1, 2, 3, 4)
    assert not hasattr(fence, "__dict__")
    with pytest.raises(AttributeError):
        fence.epoch = 9  # type: ignore[misc]
    assert {fence: 1}[Fence("s1", 1, 2, 3, 4)] == 1
    assert hash(fence) != hash(Fence("s1", 1, 2, 3, 5))


def test_fence_serializes_compactly_and_round_trips():
    fence = Fence("s1", 1, 2, 3, 4)
    raw = msgspec.msgpack.encode(fence)
    assert len(raw) < 12
    assert msgspec.msgpack.decode(raw, type=Fence) == fence


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"session_id": ""}, "non-empty"),
        ({"session_id": "x" * 129}, "longer than"),
        ({"session_id": "s", "epoch": -1}, "non-negative"),
        ({"session_id": "s", "turn_id": 1.5}, "non-negative int"),
    ],
)
def test_fence_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fence(**kwargs)


def test_fence_decode_validates_untrusted_bytes():
    raw = msgspec.msgpack.encode(["s", 0, -3, 0, 0])
    with pytest.raises(msgspec.ValidationError, match="non-negative"):
        msgspec.msgpack.decode(raw, type=Fence)


def test_successor_helpers():
    fence = Fence("s", 1, 2, 3, 4)
    assert fence.next_epoch() == Fence("s", 1, 3, 3, 4)
    assert fence.next_turn() == Fence("s", 1, 2, 4, 4)
    assert fence.next_response() == Fence("s", 1, 2, 3, 5)
    assert fence.next_incarnation() == Fence("s", 2, 0, 0, 0)
    assert str(fence) == "s/i1/e2/t3/r4"


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        (CUR, None),
        (Fence("s2", 2, 3, 4, 5), MismatchReason.SESSION),
        (Fence("s1", 1, 3, 4, 5), MismatchReason.INCARNATION),
        (Fence("s1", 3, 3, 4, 5), MismatchReason.INCARNATION),
        (Fence("s1", 2, 2, 9, 9), MismatchReason.EPOCH),
        (Fence("s1", 2, 3, 3, 9), MismatchReason.TURN),
        (Fence("s1", 2, 3, 4, 4), MismatchReason.RESPONSE),
        (Fence("s1", 2, 3, 9, 4), MismatchReason.RESPONSE),
        # A later epoch wins even with lower turn and response counters.
        (Fence("s1", 2, 4, 0, 0), None),
        (Fence("s1", 2, 3, 5, 5), None),
        (Fence("s1", 2, 3, 4, 6), None),
    ],
)
def test_fence_validation_table(candidate, reason):
    assert fence_mismatch(CUR, candidate) == reason
    if reason is None:
        assert check_fence(CUR, candidate) is candidate
    else:
        with pytest.raises(FenceMismatchError, match="fence mismatch") as info:
            check_fence(CUR, candidate)
        assert info.value.reason == reason.value
        assert info.value.code == "fence_mismatch"


def test_plain_string_where_fence_required_names_the_type():
    with pytest.raises(TypeError, match="Fence"):
        check_fence(CUR, "s1")
    with pytest.raises(TypeError, match="must be a Fence, not str"):
        require_fence("s1")
