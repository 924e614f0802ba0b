"""Several calls of one script as one EVALSHA: the script's *multi* forms.

A batch (``dataplane.batching``, ``dataplane.replicated``) sends the calls of one
script as one call of its multi form (``multi_script``): the script run once per
call inside one EVALSHA, each call with its own KEYS and ARGV and its own reply
(an error in one is that call's error only). In Redis a script call costs a few
microseconds before it does anything (parsing the command, finding the script,
entering Lua), and that is paid once per batch instead of once per call
(``tests/test_batching.py``). The calls of a multi run one after the other,
atomically together, which is stronger than each one atomic. A script with the
shared prelude (``dataplane.scripts``) has its functions defined once per multi,
and its calls' rings written once per bell when all of them have run
(``tests/test_doorbells.py``).

On a Redis Cluster a script may touch only keys of the one slot its declared keys
name, and each session is a slot of its own. A primary's batch then holds calls
of several slots, and was sent as one EVALSHA per slot. A primary with
``appendfsync always`` runs each EVALSHA as soon as all of its bytes have arrived,
and fsyncs after every read of its event loop that wrote anything. So a batch of
several EVALSHAs, read in several pieces, cost several fsyncs on the primary and on
its replica. That was most of what a cluster cost beyond one Redis (docs/scaling.md).

So the calls of one script across several slots of one primary go as one call of
its *cross-slot* form (``cross_multi_script``). It carries the flag
``allow-cross-slot-keys`` (Redis 7) and declares no keys: the calls' keys travel
in ARGV, ahead of the calls' arguments.

A declared key that is half moved by a resharding (its slot migrating, some keys
already on the new node) is redirected before the script runs. An undeclared key
would fail only when the script touches it, perhaps after the call has written
something. So a cross-slot call first probes its own keys with one ``EXISTS``
(one slot: one call's keys share a hash tag). Redis routes that probe like any
command: it fails unless every key of the call is served here now and the cluster is
up. A call that fails the probe has written nothing; its reply is Redis's "non local
key" or "cluster is down" error, and the caller sends it again on its own with
declared keys, which follows the redirection or waits out the failover
(``dataplane.replicated``, ``tests/test_cross_slot.py``). The cluster's state cannot
change while a script runs, so a call whose probe passed meets neither error later.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dataplane.scripts import BODY_MARK

CROSS_SLOT_FLAG = "allow-cross-slot-keys"

NOT_LOCAL = "non local key"
"""In Redis's error for a script touching a key this node does not serve now."""

DOWN = "cluster is down"
"""In Redis's error for a script touching a key while the cluster is down (a slot has no
live primary). A command with declared keys is refused then before it runs
(``CLUSTERDOWN``); a cross-slot call, declaring none, is refused at its probe."""

_MULTI_LOOP = """
HEAD()
local replies = {}
START()
local calls, at_key, at_arg = tonumber(all_args[base + 1]), first_key, base + 2
local nkeys, nargs
local uniform = calls < 0  -- every call has the same numbers of keys and args, given once
if uniform then
  calls, nkeys, nargs = -calls, tonumber(all_args[base + 2]), tonumber(all_args[base + 3])
  at_arg = base + 4
end
for c = 1, calls do
  if not uniform then
    nkeys, nargs = tonumber(all_args[at_arg]), tonumber(all_args[at_arg + 1])
    at_arg = at_arg + 2
  end
  KEYS = {unpack(all_keys, at_key, at_key + nkeys - 1)}
  ARGV = {unpack(all_args, at_arg, at_arg + nargs - 1)}
  at_key = at_key + nkeys
  at_arg = at_arg + nargs
  local ok, reply = pcall(run)
  if not ok then
    reply = {err = tostring(reply)}
  elseif reply == nil then
    reply = false
  end
  replies[c] = reply
end
FINISH()
return replies
"""

_DECLARED = "local all_keys, all_args, first_key, base = KEYS, ARGV, 1, 0"
"""A multi's calls' keys are its KEYS; ARGV begins with the calls' layout."""

_IN_ARGV = "local all_keys, all_args, first_key = ARGV, ARGV, 2\nlocal base = tonumber(ARGV[1]) + 1"
"""A cross-slot multi's ARGV: the number of keys, the keys, then as a multi's ARGV."""

_PROBE = "if #KEYS > 0 then redis.call('EXISTS', unpack(KEYS)) end\n"
"""Before a cross-slot call's own part: fails, writing nothing, unless every one of the
call's keys is served by this node now."""


class ScriptCall(Protocol):
    """A call of a script: the script (its ``sha`` and ``script`` text), keys, args."""

    script: Any
    keys: Sequence[Any]
    args: Sequence[Any]


class Multi:
    """A script's multi form: ARGV is the number of calls, then for each call the
    number of its keys and of its args, then its args; KEYS are the calls' keys one
    after the other. Replies: one per call, in order.

    When every call has as many keys and args as the first (a batch of appends, or of
    publishes of one stage, mostly has), ARGV is minus the number of calls, the numbers
    of keys and args once, then the calls' args: two arguments fewer per call, each one
    made into a Lua string and a number in Redis and packed here."""

    __slots__ = ("script", "sent", "sha")

    def __init__(self, script: str) -> None:
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self.sent = False
        """Sent (or loaded) once already by this batcher."""


def split_flags(script: str) -> tuple[str, str]:
    """``script``'s first line when it declares Redis script flags (``#!lua flags=...``),
    and the rest; ``("", script)`` when it declares none. Redis reads the flags only on
    a script's first line, and anywhere else the line does not compile."""
    if not script.startswith("#!"):
        return "", script
    line, _, rest = script.partition("\n")
    return line + "\n", rest


def with_flag(flags: str, flag: str) -> str:
    """A script's first line (``split_flags``; "" for none) with ``flag`` added."""
    if not flags:
        return f"#!lua flags={flag}\n"
    if "flags=" in flags:
        return flags.replace("flags=", f"flags={flag},", 1)
    return f"{flags.rstrip()} flags={flag}\n"


def multi_script(script: str, *, cross_slot: bool = False) -> Multi:
    """``script`` run once per call, its KEYS and ARGV (the upvalues it reads) set for
    each, its error caught as that call's error reply. What comes before the script's
    ``BODY_MARK`` (the shared prelude's functions) is defined once, not per call. The
    multi carries the script's flags (``split_flags``) on its first line, so Redis runs
    it as it would run the script (a multi of lease renewals runs on a full Redis too).
    ``cross_slot``: the form for calls of several slots of one node (the module's
    docstring)."""
    flags, script = split_flags(script)
    shared, mark, own = script.rpartition(BODY_MARK)
    start, finish = "multi_start()", "multi_finish()"  # the prelude's (queued rings)
    if not mark:  # a script without the prelude: all of it runs per call
        shared, own, start, finish = "", script, "", ""
    head, probe = _DECLARED, ""
    if cross_slot:
        flags, head, probe = with_flag(flags, CROSS_SLOT_FLAG), _IN_ARGV, _PROBE
    text = f"local KEYS, ARGV = KEYS, ARGV\n{shared}\nlocal function run()\n{probe}{own}\nend\n"
    loop = _MULTI_LOOP.replace("HEAD()", head).replace("START()", start)
    return Multi(flags + text + loop.replace("FINISH()", finish))


def multi_of(multis: dict[str, Multi], script: Any, *, cross_slot: bool = False) -> Multi:
    """``script``'s multi form (or cross-slot form), made once and kept in ``multis``."""
    name = f"x{script.sha}" if cross_slot else script.sha
    multi = multis.get(name)
    if multi is None:
        multi = multis[name] = multi_script(script.script, cross_slot=cross_slot)
    return multi


def _layout(group: Sequence[ScriptCall]) -> tuple[list[Any], list[Any]]:
    """The KEYS and ARGV of a multi of ``group``'s calls."""
    keys: list[Any] = []
    nkeys, nargs = len(group[0].keys), len(group[0].args)
    if all(len(c.keys) == nkeys and len(c.args) == nargs for c in group):
        args: list[Any] = [-len(group), nkeys, nargs]
        for call in group:
            keys += call.keys
            args += call.args
    else:
        args = [len(group)]
        for call in group:
            keys += call.keys
            args += (len(call.keys), len(call.args), *call.args)
    return keys, args


def group_command(group: Sequence[ScriptCall], multi: Callable[[Any], Multi]) -> tuple[Any, ...]:
    """One EVALSHA for ``group``, calls of one script: the script itself for a lone
    call, its multi form (``multi(script)``) for several."""
    if len(group) == 1:
        call = group[0]
        return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    keys, args = _layout(group)
    return ("EVALSHA", multi(group[0].script).sha, len(keys), *keys, *args)


def cross_slot_command(group: Sequence[ScriptCall], multi: Multi) -> tuple[Any, ...]:
    """One EVALSHA of ``multi``, ``group``'s script's cross-slot form, for ``group``
    (calls of several slots of one node): no declared keys; the keys' count and the
    keys lead ARGV."""
    keys, args = _layout(group)
    return ("EVALSHA", multi.sha, 0, len(keys), *keys, *args)


def group_replies(group: Sequence[ScriptCall], reply: Any) -> list[Any]:
    """Each call's reply from its group's one reply: a lone call's own; a multi's, one
    per call; an error reply (the whole EVALSHA refused) every call's."""
    if len(group) == 1:
        return [reply]
    if isinstance(reply, BaseException):
        return [reply] * len(group)
    return list(reply)
