from types import SimpleNamespace

import pytest

from dataplane.request_ids import (
    RequestIdParts,
    belongs_to_session,
    check_binding,
    data_plane_request_info,
    extract_request_ids,
    make_request_id,
    parse_request_id,
)
from schemas.fence import Fence


def test_format_and_round_trip():
    rid = make_request_id(Fence("foo", 1, 2, 3, 4), "thinker")
    assert rid == "duplex-s.Zm9v.i.1.e.2.r.thinker"
    assert parse_request_id(rid) == RequestIdParts("foo", 1, 2, "thinker")


@pytest.mark.parametrize("session_id", ["a.b.c", "foo-i1", "ünïcode/ß", "x" * 128, "=="])
def test_any_session_id_round_trips(session_id):
    rid = make_request_id(Fence(session_id, 3, 4), "talker_0")
    assert "=" not in rid
    assert parse_request_id(rid).session_id == session_id
    assert belongs_to_session(rid, session_id)


def test_lookalike_sessions_are_decided_by_decoding():
    a = make_request_id(Fence("foo-i1", 0), "r")
    b = make_request_id(Fence("foo", 1), "r")
    assert parse_request_id(a) != parse_request_id(b)
    assert belongs_to_session(a, "foo-i1") and not belongs_to_session(a, "foo")
    assert belongs_to_session(b, "foo") and not belongs_to_session(b, "foo-i1")
    # The encoded "foo-i1" starts with the encoded "foo": a prefix check would
    # wrongly count a's request as one of foo's.
    assert a.startswith(make_request_id(Fence("foo"), "r").split(".i.")[0])


@pytest.mark.parametrize("role", ["", "a.b", "a b", "ü", None])
def test_bad_role_is_rejected(role):
    with pytest.raises(ValueError, match="role"):
        make_request_id(Fence("s"), role)


def test_make_requires_a_fence():
    with pytest.raises(TypeError, match="Fence"):
        make_request_id("s", "r")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rid",
    [
        "",
        "foo",
        "duplex-s.Zm9v.i.1.e.2.r",
        "duplex-s.Zm9v.i.1.e.2.r.",
        "duplex-s.Zm9v.i.01.e.2.r.x",
        "duplex-s.Zm9v.i.-1.e.2.r.x",
        "duplex-s.Zm9v.e.1.i.2.r.x",
        "duplex-x.Zm9v.i.1.e.2.r.x",
        "duplex-s.Zm9v=.i.1.e.2.r.x",
        "duplex-s.Zm9.i.1.e.2.r.x",  # non-canonical trailing bits
        "duplex-s..i.1.e.2.r.x",
        "duplex-s.__8.i.1.e.2.r.x",  # not UTF-8
        "duplex-s.Zm9v.i.1.e.2.r.x.y",
    ],
)
def test_malformed_ids_belong_to_nobody(rid):
    with pytest.raises(ValueError):
        parse_request_id(rid)
    assert not belongs_to_session(rid, "foo")


def test_non_string_id_belongs_to_nobody():
    assert not belongs_to_session(123, "foo")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"request_id": "r1", "stage_id": 1}, ("r1", 1)),
        ({"stage_id": "talker", "request_output": {"request_id": "r2"}}, ("r2", "talker")),
        (
            SimpleNamespace(
                request_id="", request_output=SimpleNamespace(request_id="r3", stage_id=2)
            ),
            ("r3", 2),
        ),
        (SimpleNamespace(request_id="r4"), ("r4", None)),
        ({"request_id": "r5", "stage_id": True}, ("r5", None)),
        ({"stage_id": 1}, (None, None)),
        ({"request_id": "", "stage_id": 1}, (None, None)),
        ({"request_id": None, "request_output": {"request_id": ""}}, (None, None)),
        (SimpleNamespace(), (None, None)),
        ({"request_id": 7, "stage_id": 0}, (None, None)),
    ],
)
def test_extract_request_ids(result, expected):
    assert extract_request_ids(result) == expected


def test_check_binding_accepts_caller_ids_and_own_epoch_codec_ids():
    fence = Fence("foo", 1, 2)
    assert check_binding("req-stage0", fence) == "req-stage0"
    own = make_request_id(fence, "thinker")
    assert check_binding(own, fence) == own


@pytest.mark.parametrize(
    "rid",
    [
        "",
        "duplex-s.invalid.i.x.e.7.r.stage0",  # claims the codec prefix, does not decode
        make_request_id(Fence("foo", 1, 3), "thinker"),  # another epoch
        make_request_id(Fence("bar", 1, 2), "thinker"),  # another session
    ],
)
def test_check_binding_refuses_ids_of_other_fences(rid):
    with pytest.raises(ValueError):
        check_binding(rid, Fence("foo", 1, 2))


def test_data_plane_request_info_reads_objects_and_skips_other_results():
    reply = SimpleNamespace(
        stage_results=[
            SimpleNamespace(result=SimpleNamespace(data_plane_append=False, request_id="no")),
            {"result": {"data_plane_append": True, "request_id": "r1", "response_stage_id": "t"}},
        ]
    )
    assert data_plane_request_info(reply) == ("r1", "t")
    assert data_plane_request_info({"stage_results": "not a list"}) == (None, None)
    assert data_plane_request_info({}) == (None, None)
