-- Spend budgets shared by several Edges (iop_edge::limits::budget). One call per decision.
--
-- KEYS[1]: the key's UTC day hash, KEYS[2]: its UTC month hash (one hash tag: the key id).
-- Fields, in nano-dollars: c (charged: taken by Edges, spent or still held as credit) and
-- s (spent: settled costs, as Edges report them).
--
-- take ARGV: op, need, ahead, share, budget_day, budget_month, ttl_day_s, ttl_month_s, whole
--   (a budget of 0 is "none": that period's hash is neither read nor written; `whole` is the
--   request's whole reservation, of which the Edge's own credit covers `whole - need`)
--   -> {1, granted} : need + up to `ahead` more (at most 1/share of what is left), charged to
--                     both periods;
--      {0, 1 | 2}   : the day (1) or month (2) has spent too much for `whole` to ever fit;
--      {0, 3}       : it fits only once other holders give back or settle lower.
-- settle ARGV: op, give, spend, force, budget_day, budget_month, ttl_day_s, ttl_month_s
--   charged := max(0, charged - give + force); spent += spend  -> {1, 0}
--
-- Amounts are integers below 2^53 (nano-dollars: 9 million dollars), exact as Lua numbers;
-- they are written with %.0f rather than relying on how a server version formats a number.
local op = ARGV[1]
local budgets = { tonumber(ARGV[5]), tonumber(ARGV[6]) }
local ttl = { tonumber(ARGV[7]), tonumber(ARGV[8]) }
local function get(k, f)
  return tonumber(redis.call('HGET', k, f) or '0')
end
local function put(i, f, v)
  redis.call('HSET', KEYS[i], f, string.format('%.0f', v))
  redis.call('EXPIRE', KEYS[i], ttl[i])
end

if op == 'take' then
  local need, ahead, share = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local whole = tonumber(ARGV[9])
  local extra = ahead
  local charged = { 0, 0 }
  for i = 1, 2 do
    if budgets[i] > 0 then
      local c, s = get(KEYS[i], 'c'), get(KEYS[i], 's')
      if s + whole > budgets[i] then
        return { 0, i }
      end
      if c + need > budgets[i] then
        return { 0, 3 }
      end
      local rest = math.floor((budgets[i] - c - need) / share)
      if rest < extra then
        extra = rest
      end
      charged[i] = c
    end
  end
  local grant = need + extra
  for i = 1, 2 do
    if budgets[i] > 0 then
      put(i, 'c', charged[i] + grant)
    end
  end
  return { 1, grant }
elseif op == 'settle' then
  local give, spend, force = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  for i = 1, 2 do
    if budgets[i] > 0 then
      local c = get(KEYS[i], 'c') - give + force
      if c < 0 then
        c = 0
      end
      put(i, 'c', c)
      put(i, 's', get(KEYS[i], 's') + spend)
    end
  end
  return { 1, 0 }
end
return redis.error_reply('unknown op')
