"""Server-side Lua: the only code that changes a session's fence or a lease.

Each script touches the keys of one session (one hash tag, one cluster slot)
and runs atomically, so any coordinator or worker can serve any session and
two of them can never hand out the same ``seq``, move an epoch backwards, or
both own a (session, stage). The fence rule here is the one in
``dataplane.sessions`` (the Python core); ``tests/test_authority.py`` runs
the same table against both.

Events are written as msgpack built in Lua with ``cmsgpack`` plus bytes the
caller encoded with msgspec, so what lands in a stream decodes with
``schemas.events`` like any other event.

Stage keys come last in KEYS as (stage output stream, stage lease, stage
bell) triples. Every script that writes a stream rings the bell of each
consumer of that stream (``schemas.keys``), in the same atomic step.
Replies are arrays whose first element is a status word.
"""

from __future__ import annotations

from schemas.keys import BELL_LENGTH

BODY_MARK = "-- per call --"
"""Where the shared definitions end and a call's own part begins: a multi
(``dataplane.batching``) defines the functions once and runs the rest per call."""

META_LAYOUT = (
    "a hash table: this value is longer than Redis keeps in a hash stored as a flat list "
    "(hash-max-listpack-value, 64 bytes by default)"
)
"""The value of a session meta hash's ``layout`` field, written at open: a value this long
makes Redis keep the hash as a hash table (``tests/test_authority.py``)."""

_SHARED = (
    f"local BELL_LENGTH = {BELL_LENGTH}\n"
    f"local LAYOUT = '{META_LAYOUT}'\n"
    + r"""
-- msgpack of a non-negative integer and of a string of at most 255 bytes, as cmsgpack
-- packs them; written out here because each cmsgpack.pack call allocates and copies
-- buffers of its own (about 1,500 instructions a call, the append's largest piece).
local function uint(n)
  if n < 128 then return string.char(n) end
  if n < 256 then return '\204' .. string.char(n) end
  if n < 65536 then return '\205' .. string.char(math.floor(n / 256), n % 256) end
  return cmsgpack.pack(n)
end

local function short_str(s)
  if #s < 32 then return string.char(160 + #s) .. s end
  return '\217' .. string.char(#s) .. s
end

local function pack_fence(sid, inc, ep, tu, rs)
  return cmsgpack.pack({sid, inc, ep, tu, rs})
end

-- A ControlEvent: a msgpack map of six entries (see schemas.events).
local function pack_control(kind, fence, cancelled, reason, now)
  return string.char(0x86)
    .. cmsgpack.pack('t') .. cmsgpack.pack('ctl')
    .. cmsgpack.pack('kind') .. cmsgpack.pack(kind)
    .. cmsgpack.pack('fence') .. fence
    .. cmsgpack.pack('cancelled') .. (cancelled or string.char(0xc0))
    .. cmsgpack.pack('reason') .. cmsgpack.pack(reason)
    .. cmsgpack.pack('ts_ms') .. cmsgpack.pack(now)
end

-- The fence rule; returns the mismatch reason or false.
local function mismatch(cinc, cep, ctu, crs, inc, ep, tu, rs)
  if inc ~= cinc then return 'incarnation' end
  if ep ~= cep then
    if ep < cep then return 'epoch' end
    return false
  end
  if tu < ctu then return 'turn' end
  if rs < crs then return 'response' end
  return false
end

-- A lease's value is "<worker> <token> <incarnation>": the token is always between two
-- spaces.
local function holds(lease_value, token)
  return lease_value and string.find(lease_value, ' ' .. token .. ' ', 1, true)
end

-- Idempotent calls, as Kafka's idempotent producer: every caller of a mutating
-- script (a "producer": one authority object) numbers its calls on a session and
-- makes them one at a time, passing the producer id and the number as the last two
-- ARGV. The last call's number is kept in the meta hash under n:<producer> and its
-- reply under w:<producer>, as "<number> <the reply's items>" (an 'ok' reply: a status
-- word, numbers and stream ids, none with a space); a call whose number is not above
-- the kept one is a retry (its first reply was lost) and gets that reply again,
-- changing nothing. An empty producer id opts out.
-- Set for each call by ``begin`` (a multi runs several calls on one set of functions);
-- a script without a producer (publish, acquire) has other values there, never used.
local PRODUCER, PSEQ
local function begin()
  PRODUCER, PSEQ = ARGV[#ARGV - 1], ARGV[#ARGV]
end

-- The meta fields of this producer's last call: its number and its reply. Made only by
-- the scripts that have a producer (the others' last arguments are their data).
local function record_fields()
  return 'n:' .. PRODUCER, 'w:' .. PRODUCER
end

-- Whether this call's number is not above ``number``, the one kept (nil: none). Both
-- are decimal text without leading zeros, compared as text: no number is parsed.
local function seen(number)
  if not number or PRODUCER == '' then return false end
  return #number > #PSEQ or (#number == #PSEQ and number >= PSEQ)
end

-- The reply kept in a record ``raw``: its items after the number.
local function reply_of(raw)
  local reply = {}
  for item in string.gmatch(string.sub(raw, string.find(raw, ' ', 1, true) + 1), '%S+') do
    reply[#reply + 1] = tonumber(item) or item
  end
  return reply
end

-- The reply to repeat if this call was made before, or nil.
local function replayed(meta)
  if PRODUCER == '' then return nil end
  local kept = redis.call('HMGET', meta, record_fields())
  if seen(kept[1]) then return reply_of(kept[2]) end
  return nil
end

local function remember(meta, reply)
  if PRODUCER ~= '' then
    local number, record = record_fields()
    redis.call('HSET', meta, record, PSEQ .. ' ' .. table.concat(reply, ' '), number, PSEQ)
  end
  return reply
end

-- Tell a consumer that a session's streams for it changed (kind 'd': data,
-- 'c': control). The bell is capped; readers sweep now and then for lost rings. A
-- ring entry names its sessions by kind: field 'd' and field 'c', each a msgpack array
-- of session ids (one string to make in Lua, whatever the number of sessions). In a
-- multi (``multi_start``) the rings wait in RINGS and each bell gets one entry for all
-- of them once every call has run: still the same atomic step. On a cluster a bell is
-- a shard channel (``dataplane.bell_channels``): each kind's ring is one message, the
-- kind then the array, sent to the readers subscribed now and kept nowhere.
local RINGS
local function sound(bell, fields)
  if CHANNEL_BELLS then
    for i = 1, #fields, 2 do redis.call('SPUBLISH', bell, fields[i] .. fields[i + 1]) end
  else
    redis.call('XADD', bell, 'MAXLEN', '~', BELL_LENGTH, '*', unpack(fields))
  end
end

local function ring(bell, sid, kind)
  if not RINGS then
    sound(bell, {kind, '\145' .. short_str(sid)})
    return
  end
  local queued = RINGS[bell]
  if not queued then
    queued = {}
    RINGS[bell] = queued
    RINGS[#RINGS + 1] = bell
  end
  if queued[sid] ~= 'c' then queued[sid] = kind end  -- control also wakes data
end

local function multi_start()
  RINGS = {}
end

local function multi_finish()
  for _, bell in ipairs(RINGS) do
    local rung = {d = {}, c = {}}
    for sid, kind in pairs(RINGS[bell]) do
      local of_kind = rung[kind]
      of_kind[#of_kind + 1] = sid
    end
    local fields = {}
    for _, kind in ipairs({'d', 'c'}) do
      if #rung[kind] > 0 then
        fields[#fields + 1] = kind
        fields[#fields + 1] = cmsgpack.pack(rung[kind])
      end
    end
    sound(bell, fields)
  end
  RINGS = nil
end

-- Ring a stage: the bell of the worker holding the session's lease on it, so that no
-- other worker of the stage wakes. Acquire records that bell in the session's meta hash,
-- under the stage's bell key for the session (``holder_bell``): a script that rings the
-- stage reads it with the fields it reads anyway, not with a GET of the lease. No holder
-- yet, or the lease was released: nobody to tell; whoever takes the session reads it
-- then. A holder whose lease expired (killed) is still rung until another acquires: a
-- ring is a hint, and a dead worker's bell is deleted by the control plane.
local function holder_bell(stage_bell, worker)
  return stage_bell .. ':' .. worker
end

-- Lifecycle scripts' KEYS: meta in ctl out prog client_bell (stage_out lease bell)*.
-- Append a fence barrier to the client journal and every stage stream, and ring
-- every consumer: the session's control stream changed too. In the journal the barrier
-- takes the next journal seq (field n, as outputs and notices do), so the server events
-- it becomes are numbered by its own place in the journal, the same for every reader
-- of it, whatever each delivered before it (``coordinator.realtime.SEQ_STRIDE``).
-- Streams are trimmed only by the control plane, which knows what is still unread.
local function barrier(control, sid)
  local n = redis.call('HINCRBY', KEYS[1], 'oseq', 1)
  redis.call('XADD', KEYS[4], '*', 'c', control, 'n', n)
  ring(KEYS[6], sid, 'c')
  local stage_bells = {}
  for i = 9, #KEYS, 3 do stage_bells[#stage_bells + 1] = KEYS[i] end
  local held = redis.call('HMGET', KEYS[1], unpack(stage_bells))
  for n = 1, #stage_bells do
    redis.call('XADD', KEYS[4 + 3 * n], '*', 'c', control)
    if held[n] then ring(held[n], sid, 'c') end
  end
end
"""
    + BODY_MARK
    + "\nbegin()\n"
)


def prelude(*, channel_bells: bool) -> str:
    """The definitions every script starts with; ``channel_bells``: bells are shard
    channels (on a cluster, ``dataplane.bell_channels``), not streams."""
    return f"local CHANNEL_BELLS = {'true' if channel_bells else 'false'}\n" + _SHARED


PRELUDE = prelude(channel_bells=False)
"""The prelude on one Redis, where each bell is a stream."""

# KEYS: meta in ctl out prog client_bell (stage_out lease bell)*
# ARGV: sid caps now_ms requested_inc(-1: next free) producer pseq
OPEN = r"""
local again = replayed(KEYS[1])
if again then return again end
local status, oldinc = unpack(redis.call('HMGET', KEYS[1], 'status', 'inc'))
local inc = tonumber(ARGV[4])
if status == 'open' then return {'exists', tonumber(oldinc)} end
if status then
  oldinc = tonumber(oldinc)
  if inc < 0 then inc = oldinc + 1 end
  if inc <= oldinc then return {'mismatch', 'incarnation', oldinc} end
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  for i = 7, #KEYS, 3 do redis.call('DEL', KEYS[i], KEYS[i + 1]) end
elseif inc < 0 then
  inc = 0
end
redis.call('DEL', KEYS[1])
-- The layout field keeps the hash a hash table (Redis keeps a small hash as a flat list
-- while its values are short, where each field read or written is a scan from the
-- start): an append reads ten fields and writes three, a publish reads six.
redis.call('HSET', KEYS[1], 'status', 'open', 'inc', inc, 'epoch', 0, 'turn', 0, 'resp', 0,
  'seq', 0, 'tseq', 0, 'tkey', '', 'oseq', 0, 'caps', ARGV[2], 'opened_ms', ARGV[3],
  'inc0', inc, 'layout', LAYOUT)
local fence = pack_fence(ARGV[1], inc, 0, 0, 0)
redis.call('XADD', KEYS[3], '*', 'c', pack_control('open', fence, nil, '', tonumber(ARGV[3])))
return remember(KEYS[1], {'ok', inc})
"""

# KEYS: meta in bell*   (the bell of each stage reading the session's input)
# ARGV: sid mode tail attachment given(0|1) [inc ep tu rs, when given] producer pseq
# ``attachment`` (empty: no check) is the client connection the input came from: it is
# refused ({'replaced'}) unless that connection still serves the session (``ATTACH``),
# so a paused coordinator that wakes up can append nothing its old socket had buffered.
# ``tail`` is the msgpack of the event's mode, payload and ts_ms entries. The fence's
# numbers are kept as the strings read (or given) where they only go back out: turning
# a Lua number into text costs a formatted print each.
APPEND = r"""
local NUMBER, RECORD = record_fields()
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'seq', 'tseq',
  'tkey', 'caps', NUMBER, 'att', unpack(KEYS, 3))  -- m[12]...: the readers' holders' bells
if seen(m[10]) then return reply_of(redis.call('HGET', KEYS[1], RECORD)) end
if not m[1] then return {'missing'} end
if m[1] ~= 'open' then return {'closed'} end
if ARGV[4] ~= '' and m[11] ~= ARGV[4] then return {'replaced'} end
local cinc, cep, ctu, crs = tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5])
local inc, ep, tu, rs = cinc, cep, ctu, crs
local sinc, sep, stu, srs = m[2], m[3], m[4], m[5]
if ARGV[5] == '1' then
  sinc, sep, stu, srs = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
  inc, ep, tu, rs = tonumber(sinc), tonumber(sep), tonumber(stu), tonumber(srs)
  local why = mismatch(cinc, cep, ctu, crs, inc, ep, tu, rs)
  if why then return {'mismatch', why, cinc, cep, ctu, crs} end
end
if m[9] ~= '' and not string.find(' ' .. m[9] .. ' ', ' ' .. ARGV[2] .. ' ', 1, true) then
  return {'unsupported'}
end
local seq = tonumber(m[6]) + 1
local tkey = sep .. ':' .. stu
local tseq = 1
if tkey == m[8] then tseq = tonumber(m[7]) + 1 end
-- Each counter as text once: a Lua number turned into text by Redis or by a
-- concatenation costs a floating-point print each time; '%d' is an integer one.
local tseq_text = tseq == 1 and '1' or string.format('%d', tseq)
local seq_text = string.format('%d', seq)
-- An InputEvent: a map of seven entries, the last three (mode, payload, ts_ms) in the
-- caller's tail, stored as field x next to the rest (field e) rather than copied onto
-- it: readers join the two (``Entry.event``).
local event = '\135\161t\162in\165fence\149' .. short_str(ARGV[1]) .. uint(inc) .. uint(ep)
  .. uint(tu) .. uint(rs) .. '\163seq' .. uint(seq) .. '\168turn_seq' .. uint(tseq)
local id = redis.call('XADD', KEYS[2], '*', 'e', event, 'x', ARGV[3])
for i = 12, #KEYS + 9 do
  if m[i] then ring(m[i], ARGV[1], 'd') end
end
local reply = {'ok', seq, tseq, inc, ep, tu, rs, id}
-- The counters, the fence and the turn key where they moved, and the call's record,
-- in one write.
local changes = {'seq', seq_text, 'tseq', tseq_text}
if ep ~= cep or tu ~= ctu or rs ~= crs then
  changes[5], changes[6], changes[7], changes[8], changes[9], changes[10] =
    'epoch', ep, 'turn', tu, 'resp', rs
end
if tkey ~= m[8] then
  changes[#changes + 1] = 'tkey'
  changes[#changes + 1] = tkey
end
if PRODUCER ~= '' then  -- as ``remember`` keeps it, built from the strings at hand
  changes[#changes + 1] = RECORD
  changes[#changes + 1] = PSEQ .. ' ok ' .. seq_text .. ' ' .. tseq_text .. ' ' .. sinc
    .. ' ' .. sep .. ' ' .. stu .. ' ' .. srs .. ' ' .. id
  changes[#changes + 1] = NUMBER
  changes[#changes + 1] = PSEQ
end
redis.call('HSET', KEYS[1], unpack(changes))
return reply
"""

# KEYS: meta
# ARGV: inc ep tu rs   (move the fence forward without an input)
ACCEPT = r"""
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp')
if not m[1] then return {'missing'} end
if m[1] ~= 'open' then return {'closed'} end
local why = mismatch(tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]),
  tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))
if why then return {'mismatch', why, m[2], m[3], m[4], m[5]} end
redis.call('HSET', KEYS[1], 'epoch', ARGV[2], 'turn', ARGV[3], 'resp', ARGV[4])
return {'ok'}
"""

# KEYS: meta in ctl out prog client_bell (stage_out lease bell)*
# ARGV: sid reason now_ms expect_epoch(-1: any) attachment producer pseq
# ``attachment``: as for APPEND, a cancel from a connection that no longer serves the
# session is refused ({'replaced'}).
CANCEL = r"""
local again = replayed(KEYS[1])
if again then return again end
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'att')
if not m[1] then return {'missing'} end
if m[1] ~= 'open' then return {'closed'} end
if ARGV[5] ~= '' and m[6] ~= ARGV[5] then return {'replaced'} end
local inc, ep, tu, rs = tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5])
local expect = tonumber(ARGV[4])
if expect >= 0 and expect < ep then return {'already', inc, ep, tu, rs} end
redis.call('HSET', KEYS[1], 'epoch', ep + 1)
local control = pack_control('cancel', pack_fence(ARGV[1], inc, ep + 1, tu, rs),
  pack_fence(ARGV[1], inc, ep, tu, rs), ARGV[2], tonumber(ARGV[3]))
redis.call('XADD', KEYS[3], '*', 'c', control)
barrier(control, ARGV[1])
return remember(KEYS[1], {'ok', inc, ep + 1, tu, rs})
"""

# KEYS: meta in ctl out prog client_bell (stage_out lease bell)*
# ARGV: sid reason now_ms expect_inc(-1: any) ttl_s idle_before_ms(0: always) producer pseq
# With idle_before_ms, only a session a client connection attached to once and
# whose attachment lapsed before that time is closed; otherwise {'attached'}.
CLOSE = r"""
local again = replayed(KEYS[1])
if again then return again end
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'att_until')
if not m[1] then return {'missing'} end
if m[1] ~= 'open' then return {'closed'} end
local idle_before = tonumber(ARGV[6])
if idle_before > 0 and (not m[6] or tonumber(m[6]) >= idle_before) then
  return {'attached'}
end
local inc, ep, tu, rs = tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5])
local expect = tonumber(ARGV[4])
if expect >= 0 and expect ~= inc then return {'mismatch', 'incarnation', inc, ep, tu, rs} end
redis.call('HSET', KEYS[1], 'status', 'closed', 'closed_ms', ARGV[3])
local control = pack_control('close', pack_fence(ARGV[1], inc, ep, tu, rs), nil, ARGV[2],
  tonumber(ARGV[3]))
redis.call('XADD', KEYS[3], '*', 'c', control)
barrier(control, ARGV[1])
for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
for i = 7, #KEYS, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return remember(KEYS[1], {'ok', inc, ep, tu, rs})
"""

# KEYS: meta in ctl out prog client_bell (stage_out lease bell)*  -- the stage's own
# triple comes first: KEYS[7], KEYS[8], KEYS[9]
# ARGV: sid stage worker token ttl_ms now_ms
# Reply: {'ok', inc, epoch, turn, resp, failover, applied, read_id, oseq, config} (config:
# the session's settings as the coordinator stored them, '' for none), {'held', holder}
# or {'closed'}.
ACQUIRE = r"""
local stage = ARGV[2]
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'config',
  stage .. ':applied', stage .. ':read', stage .. ':oseq', stage .. ':owners')
if m[1] ~= 'open' then return {'closed'} end
if not m[10] then
  -- Never acquired since the session opened, or opened when stages kept their progress
  -- in the prog hash (KEYS[5]): what is there moves into meta.
  local names = {stage .. ':applied', stage .. ':read', stage .. ':oseq', stage .. ':owners',
    stage .. ':failures', stage .. ':failed_at'}
  local old = redis.call('HMGET', KEYS[5], unpack(names))
  local moved = {}
  for i = 1, #names do
    if old[i] then
      moved[#moved + 1] = names[i]
      moved[#moved + 1] = old[i]
    end
  end
  if #moved > 0 then redis.call('HSET', KEYS[1], unpack(moved)) end
  m[7], m[8], m[9], m[10] = old[1], old[2], old[3], old[4]
end
local holder = redis.call('GET', KEYS[8])
local applied, read_id, oseq = tonumber(m[7] or '0'), m[8] or '0-0', tonumber(m[9] or '0')
if holder and holds(holder, ARGV[4]) then
  -- A retry of an acquire that succeeded (its reply was lost): the same grant again.
  local inc = tonumber(string.match(holder, '(%d+)$'))
  return {'ok', inc, tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), 0, applied, read_id, oseq,
    m[6] or ''}
end
if holder then return {'held', holder} end
local inc, ep, tu, rs = tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5])
local owners = tonumber(m[10] or '0')
local failover = 0
if owners > 0 then
  failover = 1
  redis.call('HSET', KEYS[1], 'inc', inc + 1)
  local control = pack_control('failover', pack_fence(ARGV[1], inc + 1, ep, tu, rs),
    pack_fence(ARGV[1], inc, ep, tu, rs), stage, tonumber(ARGV[6]))
  redis.call('XADD', KEYS[3], '*', 'c', control)
  barrier(control, ARGV[1])
  inc = inc + 1
end
redis.call('SET', KEYS[8], ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. inc, 'PX', ARGV[5])
-- Whom to ring for the stage, and one owner more.
redis.call('HSET', KEYS[1], KEYS[9], holder_bell(KEYS[9], ARGV[3]), stage .. ':owners',
  string.format('%d', owners + 1))
return {'ok', inc, ep, tu, rs, failover, applied, read_id, oseq, m[6] or ''}
"""

ALLOW_OOM = "#!lua flags=allow-oom\n"
"""The first line of a script safe to run while Redis is full (at ``maxmemory``,
``noeviction``): Redis then lets its writes through instead of refusing them
(``dataplane.full``). Only for a script whose writes take no more memory. It must be the
script's very first line (``RedisBus`` puts the prelude after it). On a cluster Redis
then also refuses a script that touches keys of more than one slot, declared or not:
each script that starts with it touches only KEYS[1] (``RECEIPT``, ``APPEND_TAKEN``: keys
of one slot). The exceptions to "no more memory" are ``RECEIPT`` and ``APPEND_TAKEN``,
whose growth is bounded."""

APPEND_TAKEN = ALLOW_OOM + APPEND
"""``APPEND`` for the commit of a turn whose response a journaled notice already announced
(``response.created`` for a ``response.create``, ``Coordinator.commit``): it runs on a full
Redis too. Refused, it left a response the client was told of with no commit asking for
it. It takes memory only once per response reserved, and the reservation (``RESERVE``)
is refused on a full Redis (``tests/test_redis_full.py``)."""

# KEYS: lease     ARGV: token ttl_ms
# Runs on a full Redis (``ALLOW_OOM``): a lease must not lapse, and its session fail over,
# because Redis is full. Safe: its one write, PEXPIRE, moves the TTL of a key that has
# one already (a lease is always set with PX), which takes no more memory.
RENEW = r"""#!lua flags=allow-oom
if holds(redis.call('GET', KEYS[1]), ARGV[1]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: a sorted set     ARGV: (score member)*
# Moves the members already in the set to their new scores; replies with the members
# that are not there (``RedisBus.rescore`` adds them with a plain ZADD). Runs on a full
# Redis (``ALLOW_OOM``), so a worker's heartbeat and its leases' expiries in the lease index
# stay current. Safe: ZADD XX of a member present replaces its score in place, which
# takes no more memory; a missing member is never added here.
RESCORE = r"""#!lua flags=allow-oom
local missing = {}
for i = 1, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i + 1]) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[i], ARGV[i + 1])
  else
    missing[#missing + 1] = ARGV[i + 1]
  end
end
return missing
"""

# KEYS: lease meta stage_bell     ARGV: token
# A released session has nobody to ring for the stage until the next acquire.
RELEASE = r"""
if holds(redis.call('GET', KEYS[1]), ARGV[1]) then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], KEYS[3])
  return 1
end
return 0
"""

# KEYS: meta lease stage_out client_out bell* [client_bell]  (the bell of each stage
#       reading this stage; the client bell last for a client-facing stage)
# ARGV: stage token applied read_id where first_oseq last_oseq ngroups sid,
#       then per group: inc ep tu rs n and the group's n events once or twice: where
#       is '0' (the stage's own stream only), '1' (a client-facing stage that stages
#       read: its own stream, then the n events again for the client journal) or '2'
#       (a client-facing stage no stage reads: the client journal only; its outputs
#       are kept there once, ``PipelineConfig.outputs_in_journal``)
# Every group of outputs (one fence each) and the progress cursor are written in
# this one step, or nothing is. A group whose fence regressed is refused as
# {'stale', index, reason, current fence}; one ahead of the authority (which only
# a rollback of Redis can cause) as {'ahead', index, '', current fence}; the caller
# fixes or drops that group and calls again. A repeated call (a retry whose first
# reply was lost) is recognised by its output seqs, already recorded, and changes
# nothing. With no outputs the call only records progress: the lease is checked,
# no fence is.
PUBLISH = r"""
if not holds(redis.call('GET', KEYS[2]), ARGV[2]) then return {'lost'} end
local to_client, to_own = ARGV[5] ~= '0', ARGV[5] ~= '2'
local last_consumer = #KEYS - (to_client and 1 or 0)  -- KEYS[5..last_consumer]: their bells
local stage = ARGV[1]
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'oseq',
  stage .. ':oseq', stage .. ':applied',
  unpack(KEYS, 5, last_consumer))  -- m[9]...: the consumers' holders' bells
if m[1] ~= 'open' then return {'closed'} end
local cinc, cep, ctu, crs = tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5])
local first_oseq = tonumber(ARGV[6])
if first_oseq > 0 and first_oseq <= tonumber(m[7] or '0') then
  return {'ok', 0}
end
local groups = {}
local at = 10
for g = 1, tonumber(ARGV[8]) do
  local inc, ep, tu, rs = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]),
    tonumber(ARGV[at + 3])
  local n = tonumber(ARGV[at + 4])
  if n > 0 then
    local why = mismatch(cinc, cep, ctu, crs, inc, ep, tu, rs)
    if why then return {'stale', g, why, cinc, cep, ctu, crs} end
    if ep > cep or (ep == cep and (tu > ctu or rs > crs)) then
      return {'ahead', g, '', cinc, cep, ctu, crs}
    end
  end
  groups[g] = {at + 5, n}
  at = at + 5 + n
  if to_client and to_own then at = at + n end
end
-- The client journal's seqs continue the session's oseq (its server_event_seq), read
-- once and written back once: nothing else runs between.
local sn = tonumber(m[6] or '0')
local sn_text  -- sn as text (an integer print; Redis would print the number as a float)
local written = 0
for _, span in ipairs(groups) do
  written = written + span[2]
  local journal_copy = to_own and span[2] or 0  -- where the journal's copies start
  for i = span[1], span[1] + span[2] - 1 do
    if to_own then redis.call('XADD', KEYS[3], '*', 'e', ARGV[i]) end
    if to_client then
      sn = sn + 1
      sn_text = string.format('%d', sn)
      redis.call('XADD', KEYS[4], '*', 'e', ARGV[i + journal_copy], 'n', sn_text)
    end
  end
end
local last_sn = 0
-- The journal's oseq and the stage's progress (the applied seq and read position if they
-- moved, the stage's oseq) in one write.
local changes = {}
if written > 0 then
  if to_client then
    changes = {'oseq', sn_text}
    last_sn = sn
    ring(KEYS[#KEYS], ARGV[9], 'd')
  end
  for i = 9, last_consumer + 4 do
    if m[i] then ring(m[i], ARGV[9], 'd') end
  end
end
if tonumber(ARGV[3]) > tonumber(m[8] or '0') then
  changes[#changes + 1] = stage .. ':applied'
  changes[#changes + 1] = ARGV[3]
  changes[#changes + 1] = stage .. ':read'
  changes[#changes + 1] = ARGV[4]
end
if tonumber(ARGV[7]) > 0 then
  changes[#changes + 1] = stage .. ':oseq'
  changes[#changes + 1] = ARGV[7]
end
if #changes > 0 then redis.call('HSET', KEYS[1], unpack(changes)) end
return {'ok', last_sn}
"""

# KEYS: meta out client_bell
# ARGV: sid tail attachment producer pseq   (attachment: as for APPEND)
# A coordinator notice into the client journal, stamped with the session's
# current fence and the next server_event_seq (also its output seq), so it is
# ordered with the stages' outputs and replayed on resume like them. ``tail``
# is the msgpack of the OutputEvent entries other than t, fence and seq.
JOURNAL = r"""
local again = replayed(KEYS[1])
if again then return again end
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'turn', 'resp', 'att')
if not m[1] then return {'missing'} end
if ARGV[3] ~= '' and m[6] ~= ARGV[3] then return {'replaced'} end
local n = redis.call('HINCRBY', KEYS[1], 'oseq', 1)
local event = '\139'
  .. cmsgpack.pack('t', 'out', 'fence', {ARGV[1], tonumber(m[2]), tonumber(m[3]),
    tonumber(m[4]), tonumber(m[5])}, 'seq', n)
  .. ARGV[2]
redis.call('XADD', KEYS[2], '*', 'e', event, 'n', n)
ring(KEYS[3], ARGV[1], 'd')
return remember(KEYS[1], {'ok', n})
"""

RECEIPT = ALLOW_OOM + JOURNAL
"""``JOURNAL`` for a notice that acknowledges a write Redis already took (an item
created, a buffer cleared, a session updated): it runs on a full Redis too. Refused, the
client would hear ``redis_full`` for an event that was taken, and send it again (an input
taken twice). Its writes do take memory (the notice, its repeat memo), but one per event
taken: bounded by what Redis accepted before it filled up (``tests/test_redis_full.py``).
Its keys share one slot, as a full cluster node requires of such a script."""

# KEYS: meta
# ARGV: attachment producer pseq   (attachment: as for APPEND)
# The user's turn ended: the model's turn and the response to it are reserved,
# turn_id + 1 and response_seq + 1 (inputs after it carry the new values).
RESERVE = r"""
local again = replayed(KEYS[1])
if again then return again end
local m = redis.call('HMGET', KEYS[1], 'status', 'inc', 'epoch', 'att')
if not m[1] then return {'missing'} end
if m[1] ~= 'open' then return {'closed'} end
if ARGV[1] ~= '' and m[4] ~= ARGV[1] then return {'replaced'} end
local turn = redis.call('HINCRBY', KEYS[1], 'turn', 1)
local resp = redis.call('HINCRBY', KEYS[1], 'resp', 1)
return remember(KEYS[1], {'ok', tonumber(m[2]), tonumber(m[3]), turn, resp})
"""

# KEYS: meta
# ARGV: attachment key_digest until_ms resume(0|1) presented fresh
# A client connection becomes the one that serves the session (on open, or on a
# resume from any coordinator). The connection it replaces learns so at its next HOLD,
# and every write it makes from now on is refused (the attachment checks of APPEND,
# CANCEL, RESERVE, JOURNAL and CONFIGURE). On open the digest of the API key is
# recorded; a resume must present the same key.
# Resume tokens (their digests ``presented`` and ``fresh``): open records ``fresh`` as
# the session's one pending token (tok). A resume must present a pending token or the
# token they were handed out for (tok_prev, the last one the client proved it holds by
# using it). Presenting a pending token proves the client got it: it becomes tok_prev,
# and every other token is no longer good. Presenting tok_prev again keeps every
# pending token good and adds ``fresh`` (at most four pending, the oldest dropped):
# the client may hold any of them, since a resume whose reply was lost is made again
# with tok_prev, and a resume its client gave up on (its socket silent, its coordinator
# paused) can still be taken after the client's later one was answered; neither may
# cost the client the token it holds. The reply names the tokens no longer good,
# separated by spaces ('' for none), whose lookup keys the caller deletes. Repeating a
# call changes nothing more (its ``fresh`` is already pending).
ATTACH = r"""
local m = redis.call('HMGET', KEYS[1], 'status', 'key', 'att', 'tok', 'tok_prev')
if m[1] ~= 'open' then return {'closed'} end
local dropped = {}
if ARGV[4] == '1' then
  if (m[2] or '') ~= ARGV[2] then return {'forbidden'} end
  local pending = {}  -- no tok: opened before tokens were kept, the one presented stands
  for t in string.gmatch(m[4] or ARGV[5], '%S+') do pending[#pending + 1] = t end
  local used = false
  for _, t in ipairs(pending) do
    if ARGV[6] ~= '' and t == ARGV[6] then return {'ok', '', ''} end
    if t == ARGV[5] then used = true end
  end
  if used then
    if m[5] then dropped[#dropped + 1] = m[5] end
    for _, t in ipairs(pending) do
      if t ~= ARGV[5] then dropped[#dropped + 1] = t end
    end
    redis.call('HSET', KEYS[1], 'tok_prev', ARGV[5])
    pending = {}
  elseif ARGV[5] ~= m[5] then
    return {'expired'}
  elseif #pending >= 4 then
    dropped[#dropped + 1] = table.remove(pending, 1)
  end
  pending[#pending + 1] = ARGV[6]
  redis.call('HSET', KEYS[1], 'key', ARGV[2], 'att', ARGV[1], 'att_until', ARGV[3],
    'tok', table.concat(pending, ' '))
  return {'ok', m[3] or '', table.concat(dropped, ' ')}
end
redis.call('HSET', KEYS[1], 'key', ARGV[2], 'att', ARGV[1], 'att_until', ARGV[3], 'tok', ARGV[6])
return {'ok', m[3] or '', ''}
"""

# KEYS: meta    ARGV: attachment config
# Store a session.update's merged configuration (what a resume and a new stage owner
# start from), only while ``attachment`` serves the session ({'replaced'} otherwise).
CONFIGURE = r"""
local m = redis.call('HMGET', KEYS[1], 'status', 'att')
if m[1] ~= 'open' then return {'closed'} end
if m[2] ~= ARGV[1] then return {'replaced'} end
redis.call('HSET', KEYS[1], 'config', ARGV[2])
return {'ok'}
"""

# KEYS: meta    ARGV: attachment until_ms
# Renew a live connection's attachment; 'replaced' when another connection took
# the session over (the caller then closes its connection).
# Runs on a full Redis (``ALLOW_OOM``): a live client's attachment must not lapse (the
# control plane would close its session as abandoned). Safe: it writes only when the
# connection holds the session, and then replaces att_until, which ATTACH set with the
# same connection, by a number as long: no more memory.
HOLD = r"""#!lua flags=allow-oom
local m = redis.call('HMGET', KEYS[1], 'status', 'att')
if m[1] ~= 'open' then return 'closed' end
if m[2] ~= ARGV[1] then return 'replaced' end
redis.call('HSET', KEYS[1], 'att_until', ARGV[2])
return 'ok'
"""

# KEYS: meta    ARGV: attachment now_ms
# The connection went away: the resume grace period starts now (if it was still
# the session's connection). Runs on a full Redis (``ALLOW_OOM``), so the grace starts
# when the client left. Safe: it writes only when the connection holds the session, and
# then replaces att (by '') and att_until (by a number as long): no more memory.
DETACH = r"""#!lua flags=allow-oom
if redis.call('HGET', KEYS[1], 'att') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'att', '', 'att_until', ARGV[2])
return 1
"""

# KEYS: meta key*    ARGV: ttl_s
# The control plane's safety net: a session that is not open (closed, or its meta
# gone) gets a TTL on each of its keys that has none. Atomic with the status check,
# so a session reopened meanwhile is never touched.
EXPIRE_CLOSED = r"""
if redis.call('HGET', KEYS[1], 'status') == 'open' then return 0 end
local n = 0
for i = 2, #KEYS do n = n + redis.call('EXPIRE', KEYS[i], ARGV[1], 'NX') end
return n
"""

# KEYS: key    ARGV: value ttl_s
# A plain SET with a TTL, as a script so that on a cluster it is acknowledged only
# once a replica has it (``dataplane.replicated``): a resume token must survive the
# loss of the primary that stored it.
SET_DURABLE = r"""
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
