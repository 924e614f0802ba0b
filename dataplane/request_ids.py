"""Stage request ids derived from a fence, and their decoder.

Format::

    duplex-s.<urlsafe-b64(session_id), no padding>.i.<incarnation>.e.<epoch>.r.<role>

The session id is base64-encoded so that any session id (dots, dashes, unicode)
round-trips and no id can be a prefix of another's encoding by accident. Which
session a request belongs to is decided by decoding, never by string prefix:
``foo-i1`` at incarnation 0 and ``foo`` at incarnation 1 are different sessions
whose ids merely look alike.

A caller may also choose its own request ids (``"req-stage0"``) and bind them
to a session's stages: ``check_binding`` accepts any such opaque id, and only
refuses ids that claim the codec's prefix without decoding, or decode to
another fence's epoch. Membership of an opaque id is then known from the
binding that recorded it, not from the id.

The data-plane reply of an append is scanned by ``data_plane_request_info``:
the request a ``data_plane_append`` stage result names, and the stage that
will answer it.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from schemas.fence import Fence, require_fence

PREFIX = "duplex-s"
_ROLE = re.compile(r"[A-Za-z0-9_-]+")
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


class RequestIdParts(NamedTuple):
    session_id: str
    incarnation: int
    epoch: int
    role: str


def _b64(session_id: str) -> str:
    return base64.urlsafe_b64encode(session_id.encode()).rstrip(b"=").decode("ascii")


def make_request_id(fence: Fence, role: str) -> str:
    """The id of the stage request serving ``fence``'s epoch in ``role``."""
    require_fence(fence)
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise ValueError(f"request role must match [A-Za-z0-9_-]+, got {role!r}")
    return f"{PREFIX}.{_b64(fence.session_id)}.i.{fence.incarnation}.e.{fence.epoch}.r.{role}"


def _decode_session(encoded: str) -> str:
    if not encoded or not re.fullmatch(r"[A-Za-z0-9_-]+", encoded):
        raise ValueError("session part is not urlsafe base64")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        session_id = raw.decode()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError("session part does not decode") from exc
    # Only the canonical encoding is accepted, so one session has one spelling.
    if _b64(session_id) != encoded:
        raise ValueError("session part is not canonically encoded")
    return session_id


def parse_request_id(request_id: str) -> RequestIdParts:
    """Decode a request id; raises ValueError when it is not one of ours."""
    if not isinstance(request_id, str):
        raise ValueError(f"request id must be a string, not {type(request_id).__name__}")
    parts = request_id.split(".")
    if len(parts) != 8 or parts[0] != PREFIX or parts[2:7:2] != ["i", "e", "r"]:
        raise ValueError(f"malformed request id {request_id!r}")
    _, encoded, _, incarnation, _, epoch, _, role = parts
    if not (_DECIMAL.fullmatch(incarnation) and _DECIMAL.fullmatch(epoch)):
        raise ValueError(f"malformed counters in request id {request_id!r}")
    if not _ROLE.fullmatch(role):
        raise ValueError(f"malformed role in request id {request_id!r}")
    return RequestIdParts(_decode_session(encoded), int(incarnation), int(epoch), role)


def belongs_to_session(request_id: str, session_id: str) -> bool:
    """Whether ``request_id`` decodes to ``session_id``; malformed ids belong to nobody."""
    try:
        return parse_request_id(request_id).session_id == session_id
    except ValueError:
        return False


def check_binding(request_id: object, fence: Fence) -> str:
    """``request_id`` if it may be bound to a stage under ``fence``; else raise.

    A codec id must decode to ``fence``'s session, incarnation and epoch; an id
    that starts with the codec's prefix but does not decode is refused (it
    would look like ours and belong to nobody). Any other non-empty string is a
    caller-chosen id, accepted as it is.
    """
    require_fence(fence)
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    if not request_id.startswith(PREFIX + "."):
        return request_id
    parts = parse_request_id(request_id)
    if (parts.session_id, parts.incarnation, parts.epoch) != (
        fence.session_id,
        fence.incarnation,
        fence.epoch,
    ):
        raise ValueError(f"request {request_id!r} does not belong to fence {fence}")
    return request_id


def _field(obj: object, name: str) -> object:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def extract_request_ids(stage_result: object) -> tuple[str | None, str | int | None]:
    """``(request_id, response_stage_id)`` from one stage result.

    A stage result is a mapping or an object. The request id is read from its
    ``request_id``, or failing that from its nested ``request_output`` (the
    engine's own output object); the stage from ``stage_id`` at the same two
    places. A missing or empty request id gives ``(None, None)``: a result
    that names no request cannot be routed to a fence.
    """
    nested = _field(stage_result, "request_output")
    request_id = _field(stage_result, "request_id")
    if not request_id and nested is not None:
        request_id = _field(nested, "request_id")
    if not isinstance(request_id, str) or not request_id:
        return None, None
    stage_id = _field(stage_result, "stage_id")
    if stage_id is None and nested is not None:
        stage_id = _field(nested, "stage_id")
    if isinstance(stage_id, bool) or not isinstance(stage_id, str | int):
        stage_id = None
    return request_id, stage_id


def data_plane_request_info(reply: object) -> tuple[str | None, str | int | None]:
    """``(request_id, response_stage_id)`` of the append named in ``reply``.

    ``reply`` carries ``stage_results``, a sequence of stage results whose
    ``result`` is a mapping or object; the first result with a true
    ``data_plane_append`` is read. Its ``request_id`` must be a non-empty
    string and its ``response_stage_id`` an int or a string (a bool is
    neither). Anything else, or no such result, gives ``(None, None)``.
    """
    results = _field(reply, "stage_results")
    if not isinstance(results, Sequence) or isinstance(results, str | bytes):
        return None, None
    for stage_result in results:
        result = _field(stage_result, "result")
        if result is None or _field(result, "data_plane_append") is not True:
            continue
        request_id = _field(result, "request_id")
        if not isinstance(request_id, str) or not request_id:
            return None, None
        stage_id = _field(result, "response_stage_id")
        if isinstance(stage_id, bool) or not isinstance(stage_id, str | int):
            stage_id = None
        return request_id, stage_id
    return None, None
