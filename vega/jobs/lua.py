"""The Lua scripts the durable job store runs (vega/jobs/redis_store.py).

Each is one step over the keys of one model (they share its hash tag, so one Cluster
slot) that must not be torn. Their comments give KEYS and ARGV as the store passes them.
"""

# KEYS: stream, job, idempotency key. ARGV: id, max depth, record ttl ms, body print
# ('' without a key), then the record's field/value pairs. {0, id} added; {1, id} the
# key's earlier job; {2} the key with another body; {3, depth} the backlog is full.
SUBMIT = """
local status = redis.call('HGET', KEYS[2], 'status')
if status == 'withdrawn' then return {4, ''} end
if status then return {0, ARGV[1]} end
if ARGV[4] ~= '' then
  local held = redis.call('GET', KEYS[3])
  if held then
    local sep = string.find(held, '|', 1, true)
    if string.sub(held, 1, sep - 1) == ARGV[4] then return {1, string.sub(held, sep + 1)} end
    return {2, ''}
  end
end
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[2]) then return {3, tostring(depth)} end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[2], 'entry', entry, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
if ARGV[4] ~= '' then
  redis.call('SET', KEYS[3], ARGV[4] .. '|' .. ARGV[1], 'PX', ARGV[3])
  redis.call('HSET', KEYS[2], 'idem', KEYS[3])
end
return {0, ARGV[1]}
"""

# KEYS: an idempotency key. ARGV: the value it held. Deleted only if it still holds it.
FORGET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: the records of jobs of one model (one slot). Per job, its attempt number when it
# may run now, else -1 (finished or cancelled). One script, not a pipeline of scripts: a
# Redis Cluster client refuses scripts in a pipeline. Status and attempt in one HSET: a
# script is not rolled back when a later command in it is refused (an ACL, OOM).
START = """
local attempts = {}
for i, key in ipairs(KEYS) do
  local status = redis.call('HGET', key, 'status')
  if status == 'queued' or status == 'running' then
    attempts[i] = tonumber(redis.call('HGET', key, 'attempts') or '0') + 1
    redis.call('HSET', key, 'status', 'running', 'attempts', attempts[i])
  else
    attempts[i] = -1
  end
end
return attempts
"""

# KEYS: stream, job, idempotency key. ARGV: record ttl ms, the key's value ('' without
# one), '1' to keep a job stored already. After a submit's answer timed out: whichever of
# the two runs first, the job is taken once or not at all. A job with a status is kept
# (answered 202) when ARGV[3] says so, or when a runner took it. Else a queued job comes out
# of the stream, its key is freed, and a marker stays that a later submit finds.
WITHDRAW = """
local status = redis.call('HGET', KEYS[2], 'status')
if status and (status ~= 'queued' or ARGV[3] == '1') then return status end
local entry = redis.call('HGET', KEYS[2], 'entry')
if entry then
  redis.call('XACK', KEYS[1], 'workers', entry)
  redis.call('XDEL', KEYS[1], entry)
end
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('DEL', KEYS[3]) end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'status', 'withdrawn')
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return 'withdrawn'
"""

# KEYS: job, stream, dlq, dead count. ARGV: status, finished ms, result ttl ms, entry,
# outputs, error, dead-letter flag, dlq maxlen, job id. A final record is never
# overwritten. Its Idempotency-Key (same slot) lives as long as it: a job finished long
# after its ttl (reached late in a deep backlog) outlives the key's first TTL.
FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_ms', ARGV[2])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'outputs', ARGV[5]) end
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6]) end
  if ARGV[7] == '1' then
    local inputs = redis.call('HGET', KEYS[1], 'inputs') or ''
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'kind', 'job', 'job', KEYS[1],
               'reason', ARGV[6], 'inputs', inputs)
    redis.call('INCR', KEYS[4])
  end
  redis.call('HDEL', KEYS[1], 'inputs')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  local idem = redis.call('HGET', KEYS[1], 'idem')
  if idem then
    local held = redis.call('GET', idem)
    if held and string.sub(held, -(#ARGV[9] + 1)) == '|' .. ARGV[9] then
      redis.call('PEXPIRE', idem, ARGV[3])
    end
  end
end
if ARGV[4] ~= '' then
  redis.call('XACK', KEYS[2], 'workers', ARGV[4])
  redis.call('XDEL', KEYS[2], ARGV[4])
end
return 0
"""

# KEYS: job, stream. ARGV: entry, job id, 1 to give back the attempt (else 0). Back in the
# stream as a new entry.
RETRY = """
local status = redis.call('HGET', KEYS[1], 'status')
redis.call('XACK', KEYS[2], 'workers', ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
if status == 'queued' or status == 'running' then
  local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[2])
  redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', entry)
  if ARGV[3] ~= '0' then
    redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  end
end
return 0
"""

# KEYS: job, stream. ARGV: now ms, result ttl ms. {0} unknown, {1} cancelled, {2, status}.
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {0, ''} end
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires_ms') or '0')
if status == 'queued' and expires <= tonumber(ARGV[1]) then return {2, 'expired'} end
if status ~= 'queued' then return {2, status} end
local entry = redis.call('HGET', KEYS[1], 'entry')
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_ms', ARGV[1])
redis.call('HDEL', KEYS[1], 'inputs')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if entry then
  redis.call('XACK', KEYS[2], 'workers', entry)
  redis.call('XDEL', KEYS[2], entry)
end
return {1, 'cancelled'}
"""
