"""Errors that can reach a client, each with a stable code.

Hierarchy::

    DuplexqError                      code, retryable, message
    ├── FenceMismatchError            fence_mismatch: a message or call carries a regressed fence
    ├── SessionError
    │   ├── SessionExistsError        session_exists: open of a live session id
    │   ├── SessionNotFoundError      session_not_found
    │   ├── SessionClosedError        session_closed: reopen needs a higher incarnation
    │   └── SessionReplacedError      session_replaced: the connection no longer serves
    │                                 the session (it resumed on another connection)
    ├── ResourceExhaustedError        resource_exhausted (retryable): a capacity limit
    │   └── SessionLimitError         session_limit (retryable): too many live sessions for
    │                                 the API key or the deployment
    ├── InputBackpressureError        input_backpressure (retryable): too much pending input
    ├── RateLimitedError              rate_limited (retryable): a connection sent events
    │                                 faster than its rate
    ├── RedisFullError                redis_full (retryable): Redis is at maxmemory and
    │                                 refused a write (``dataplane.full``)
    ├── InvalidInputError             a client or wire input that failed validation
    │   ├── UnsupportedModeError      unsupported_mode (also a ValueError, "not supported")
    │   ├── WireDecodeError           invalid_wire_event: bytes from Redis that do not decode
    │   └── ProtocolError             a client event refused at the edge; its code says why:
    │                                 invalid_json, unknown_event, invalid_event,
    │                                 event_too_large, invalid_base64, invalid_audio,
    │                                 invalid_image, unsupported_field (a session
    │                                 field duplexq does not do; the error names it);
    │                                 and the reference API's own:
    │                                 conversation_already_has_active_response,
    │                                 item_delete_invalid_item_id,
    │                                 item_retrieve_invalid_item_id,
    │                                 input_audio_buffer_commit_empty
    └── AuthError                     unauthorized / resume_failed

Third-party exceptions are translated where they enter duplexq
(``raise WireDecodeError(...) from exc``), so callers only catch these.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Stable error codes; clients match on these strings, so never rename one."""

    FENCE_MISMATCH = "fence_mismatch"
    SESSION_EXISTS = "session_exists"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_CLOSED = "session_closed"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    INPUT_BACKPRESSURE = "input_backpressure"
    INVALID_INPUT = "invalid_input"
    UNSUPPORTED_MODE = "unsupported_mode"
    INVALID_WIRE_EVENT = "invalid_wire_event"
    INVALID_JSON = "invalid_json"
    UNKNOWN_EVENT = "unknown_event"
    INVALID_EVENT = "invalid_event"
    UNSUPPORTED_FIELD = "unsupported_field"
    EVENT_TOO_LARGE = "event_too_large"
    INVALID_BASE64 = "invalid_base64"
    INVALID_AUDIO = "invalid_audio"
    INVALID_IMAGE = "invalid_image"
    UNAUTHORIZED = "unauthorized"
    RESUME_FAILED = "resume_failed"
    STAGE_ERROR = "stage_error"
    SESSION_FAILED = "session_failed"
    """A stage failed on the session too many times in a row; it was closed."""
    SESSION_LIMIT = "session_limit"
    """Opening a session would exceed the live sessions allowed for the API key
    (``max_sessions_per_key``) or for the deployment (``max_sessions_total``)."""
    RATE_LIMITED = "rate_limited"
    """A connection sent events faster than ``max_events_per_s`` allows; the event was
    refused, the connection goes on."""
    FUNCTION_CALL_STALE = "function_call_stale"
    """A function's result for a call whose response was interrupted since: refused
    once, taken when the client sends it again."""
    ITEM_NOT_FOUND = "item_not_found"
    """``conversation.item.truncate`` of an item this connection knows no spoken audio of."""
    SESSION_REPLACED = "session_replaced"
    """A write from a client connection that no longer serves its session (the client
    resumed on another connection meanwhile): refused; that connection is closed."""
    RESPONSE_CANCEL_NOT_ACTIVE = "response_cancel_not_active"
    """``response.cancel`` while no response is reserved or streaming (as the reference
    API answers it); ``barge_in`` is never refused."""
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
    """``response.create`` while a response is in progress (as the reference API answers
    it): refused; the response in progress goes on."""
    ITEM_DELETE_INVALID_ITEM_ID = "item_delete_invalid_item_id"
    """``conversation.item.delete`` of an item the conversation does not hold."""
    ITEM_RETRIEVE_INVALID_ITEM_ID = "item_retrieve_invalid_item_id"
    """``conversation.item.retrieve`` of an item the conversation does not hold."""
    INPUT_AUDIO_BUFFER_COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    """``input_audio_buffer.commit`` with no audio appended since the last commit or
    clear: nothing is committed."""
    REDIS_FULL = "redis_full"
    """Redis is at its ``maxmemory`` (``noeviction``) and refused the write an event needed:
    the event was not taken; the connection and the session go on, and the same event
    succeeds once Redis has room (``tests/test_redis_full.py``)."""


class DuplexqError(Exception):
    """Base of every duplexq error; ``code`` is what the client sees."""

    code: ErrorCode = ErrorCode.INVALID_INPUT
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FenceMismatchError(DuplexqError):
    """A fence regressed against the session's current one.

    ``reason`` is one of the short words of ``dataplane.sessions.MismatchReason``
    so drop counters can be keyed by it.
    """

    code = ErrorCode.FENCE_MISMATCH

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"fence mismatch ({reason}): {detail}")
        self.reason = reason


class SessionError(DuplexqError):
    """A session lifecycle call that does not fit the session's state."""


class SessionExistsError(SessionError):
    code = ErrorCode.SESSION_EXISTS


class SessionNotFoundError(SessionError):
    code = ErrorCode.SESSION_NOT_FOUND


class SessionClosedError(SessionError):
    code = ErrorCode.SESSION_CLOSED


class SessionReplacedError(SessionError):
    code = ErrorCode.SESSION_REPLACED


class ResourceExhaustedError(DuplexqError):
    """A capacity limit was hit; the same call may succeed later."""

    code = ErrorCode.RESOURCE_EXHAUSTED
    retryable = True


class SessionLimitError(ResourceExhaustedError):
    code = ErrorCode.SESSION_LIMIT


class RateLimitedError(DuplexqError):
    code = ErrorCode.RATE_LIMITED
    retryable = True


class RedisFullError(DuplexqError):
    """Redis refused a write for memory (``OOM command not allowed``): nothing of the
    call was written, and the same call may succeed once Redis has room."""

    code = ErrorCode.REDIS_FULL
    retryable = True


class InputBackpressureError(DuplexqError):
    code = ErrorCode.INPUT_BACKPRESSURE
    retryable = True


class InvalidInputError(DuplexqError):
    code = ErrorCode.INVALID_INPUT


class UnsupportedModeError(InvalidInputError, ValueError):
    code = ErrorCode.UNSUPPORTED_MODE


class WireDecodeError(InvalidInputError, ValueError):
    code = ErrorCode.INVALID_WIRE_EVENT


class ProtocolError(InvalidInputError):
    """A client event refused at the edge; the connection and session stay up."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AuthError(DuplexqError):
    code = ErrorCode.UNAUTHORIZED

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNAUTHORIZED) -> None:
        super().__init__(message)
        self.code = code
