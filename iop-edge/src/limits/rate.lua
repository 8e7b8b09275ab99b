-- The rate rule of iop_edge_core::ratelimit (GCRA) over Redis, one call per decision, for
-- Edges sharing a key's limits (iop_edge::limits::shared). A differential test runs it against
-- the pure rule (iop-edge/tests/rate_script.rs): same decisions, same state.
--
-- KEYS: one per limited quantity of one key, all with the key's hash tag (one slot).
--   Each holds the quantity's TAT (theoretical arrival time, microseconds) or is absent (at
--   rest: fully replenished).
-- ARGV[1]: "borrow" (take `units` and up to `ahead` more, the extra at most 1/`share` of what
--   remains, every quantity or none), "charge" (units used past a reservation: always taken)
--   or "refund" (units never used: given back).
-- ARGV[2]: now in microseconds, or 0 for the server's clock (TIME): the clock every Edge then
--   shares.
-- ARGV[3]: extra milliseconds a key lives past its TAT (it expires once at rest).
-- ARGV[4 + 5(i-1) ..]: for KEYS[i]: limit, period_us, units, ahead, share.
--
-- Arithmetic is in Lua numbers (doubles); the Edge accepts only limits with
-- limit * period_us < 2^53, where every product and quotient below is exact.
--
-- Reply: {allowed (1/0), now, then per key: its own check (1/0), granted, remaining,
--   reset_after_us, retry_after_us (-1: none)}; for charge and refund: {1, now}.
local op = ARGV[1]
local now = tonumber(ARGV[2])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local linger = tonumber(ARGV[3])
local q = {}
for i = 1, #KEYS do
  local b = 4 + (i - 1) * 5
  q[i] = {
    limit = tonumber(ARGV[b]),
    period = tonumber(ARGV[b + 1]),
    units = tonumber(ARGV[b + 2]),
    ahead = tonumber(ARGV[b + 3]),
    share = math.max(tonumber(ARGV[b + 4]), 1),
    tat = tonumber(redis.call('GET', KEYS[i]) or '0'),
  }
end

local function span_up(r, units) return math.ceil(units * r.period / r.limit) end
local function span_down(r, units) return math.floor(units * r.period / r.limit) end
local function units_in(r, us) return math.floor(us * r.limit / r.period) end

-- Gcra::check: allowed, remaining, reset_after, retry_after (-1: none).
local function check(r, cost)
  local base = math.max(r.tat, now)
  local held = base - now
  local after = base + span_up(r, cost) - now
  if cost <= r.limit and after <= r.period then
    return true, units_in(r, r.period - after), after, -1
  end
  local retry = -1
  if cost <= r.limit then retry = after - r.period end
  return false, units_in(r, math.max(r.period - held, 0)), held, retry
end

local function store(key, tat)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, string.format('%.0f', tat), 'PX',
      math.ceil((tat - now) / 1000) + linger)
  end
end

if op == 'charge' then
  for i = 1, #KEYS do
    local r = q[i]
    store(KEYS[i], math.max(r.tat, now) + span_up(r, r.units))
  end
  return {1, now}
elseif op == 'refund' then
  for i = 1, #KEYS do
    local r = q[i]
    store(KEYS[i], math.max(r.tat - span_down(r, r.units), 0))
  end
  return {1, now}
end

local out = {0, now}
local all = true
local d = {}
for i = 1, #KEYS do
  local allowed, remaining, reset, retry = check(q[i], q[i].units)
  d[i] = {remaining, reset, retry, allowed and 1 or 0}
  if not allowed then all = false end
end
if not all then
  for i = 1, #KEYS do
    out[#out + 1] = d[i][4]
    out[#out + 1] = 0
    out[#out + 1] = d[i][1]
    out[#out + 1] = d[i][2]
    out[#out + 1] = d[i][3]
  end
  return out
end
out[1] = 1
for i = 1, #KEYS do
  local r = q[i]
  local extra = math.min(r.ahead, math.floor(d[i][1] / r.share))
  local granted = r.units + extra
  local allowed, remaining, reset = check(r, granted)
  if not allowed then
    granted = r.units
    allowed, remaining, reset = check(r, granted)
  end
  store(KEYS[i], math.max(r.tat, now) + span_up(r, granted))
  out[#out + 1] = 1
  out[#out + 1] = granted
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = -1
end
return out
