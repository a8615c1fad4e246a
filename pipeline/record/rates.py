"""Send rates shared by every mailer of every run on one Redis: a relay's or a receiving
domain's messages a second, its throttle replies and its daily quota.

Each bucket is one hash (record/keys.py: `cn:rate:relay:HOST:PORT`, `cn:rate:domain:DOMAIN`), moved by one Lua
call. A mailer reserves a batch of send times at once (GCRA: the hash holds the theoretical
arrival time, `tat`), so Redis is asked once per batch, not once per mail, and the times the
cluster reserves never come closer together than the rate allows. The clock is Redis's, so
the nodes' clocks do not matter. A throttle reply halves the rate (at most once per pause,
so the replies to mail already in flight do not halve it again), and the rate then grows back
by a twentieth of the ceiling a second: additive increase, multiplicative decrease.
"""

from __future__ import annotations

import redis

from pipeline.record.keys import RATE_PREFIX, rate_bucket
from pipeline.record.state import PATIENCE_RETRIES, redis_client
from pipeline.settings import Settings

RECOVERY = 0.05  # of the ceiling, a second
FLOOR = 0.02  # of the ceiling: the lowest a cut may take a rate
KEEP_S = 2 * 86400

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local day = math.floor(tonumber(t[1]) / 86400)
local function f(x) return string.format('%.17g', x) end
local function grown(h_rate, h_ceiling, h_at, ceiling)
  local rate = tonumber(h_rate) or ceiling
  if tonumber(h_ceiling) ~= ceiling then rate = ceiling end
  return math.min(ceiling, rate + (now - (tonumber(h_at) or now)) * ceiling * RECOVERY)
end
"""

# KEYS[1] the bucket; ARGV: want, ceiling, daily (0: none), horizon_s, unused (granted earlier, never sent)
# -> {granted (-1: stopped for the day), seconds until the first granted time (or until room), rate}
TAKE = "local RECOVERY = " + str(RECOVERY) + _NOW + """
local want, ceiling, daily = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local horizon, unused = tonumber(ARGV[4]), tonumber(ARGV[5])
local h = redis.call('HMGET', KEYS[1], 'tat', 'rate', 'ceiling', 'at', 'day', 'sent', 'stopped')
local rate = grown(h[2], h[3], h[4], ceiling)
local sent = 0
if tonumber(h[5]) == day then sent = math.max(0, (tonumber(h[6]) or 0) - unused) end
redis.call('HSET', KEYS[1], 'rate', f(rate), 'ceiling', f(ceiling), 'at', f(now), 'day', day, 'sent', sent)
redis.call('EXPIRE', KEYS[1], """ + str(KEEP_S) + """)
local spent = daily > 0 and sent >= daily
if spent then redis.call('HSET', KEYS[1], 'stopped', day) end
if spent or tonumber(h[7]) == day then return {-1, '0', f(rate)} end
if daily > 0 then want = math.min(want, daily - sent) end
local tat = math.max(tonumber(h[1]) or now, now)
local n = math.min(want, math.floor((now + horizon - tat) * rate + 1e-9))
if n <= 0 then return {0, f(tat - horizon - now + want / rate), f(rate)} end  -- room for the whole batch
redis.call('HSET', KEYS[1], 'tat', f(tat + n / rate), 'sent', sent + n)
return {n, f(tat - now), f(rate)}
"""

# KEYS[1]; ARGV: ceiling (0: a relay without a rate: the reply is only counted), pause_s -> the rate now
THROTTLED = "local RECOVERY = " + str(RECOVERY) + _NOW + """
local ceiling, pause = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('HINCRBY', KEYS[1], 'throttles', 1)
redis.call('EXPIRE', KEYS[1], """ + str(KEEP_S) + """)
if ceiling <= 0 then return '0' end
local h = redis.call('HMGET', KEYS[1], 'rate', 'ceiling', 'at', 'cut_at', 'tat')
local rate = grown(h[1], h[2], h[3], ceiling)
if now - (tonumber(h[4]) or 0) >= pause then
  rate = math.max(ceiling * """ + str(FLOOR) + """, rate / 2)
  redis.call('HSET', KEYS[1], 'cut_at', f(now), 'tat', f(math.max(tonumber(h[5]) or now, now) + 1 / rate))
  redis.call('HINCRBY', KEYS[1], 'cuts', 1)
end
redis.call('HSET', KEYS[1], 'rate', f(rate), 'ceiling', f(ceiling), 'at', f(now))
return f(rate)
"""

STOP = "local RECOVERY = 0" + _NOW + """
redis.call('HSET', KEYS[1], 'stopped', day)
redis.call('HINCRBY', KEYS[1], 'quota_replies', 1)
redis.call('EXPIRE', KEYS[1], """ + str(KEEP_S) + """)
return day
"""


class RedisBuckets:
    """The buckets on the run's Redis (pipeline/mail/pacing.py takes from them)."""

    def __init__(self, redis_url: str, patience_s: float = Settings.redis_patience_s, deadline_at: float = 0.0):
        # the run's own client: a Redis restart pauses the pacing too, as long as the run waits for it
        self.r = redis_client(redis_url, PATIENCE_RETRIES, patience_s, deadline_at)
        self._take, self._throttled = self.r.register_script(TAKE), self.r.register_script(THROTTLED)
        self._stop = self.r.register_script(STOP)

    def take(self, name: str, want: int, ceiling: float, daily: int, horizon_s: float,
             unused: int = 0) -> tuple[int, float, float]:
        n, start_in, rate = self._take(keys=[rate_bucket(name)], args=[want, repr(float(ceiling)), daily,
                                                                  repr(float(horizon_s)), unused])
        return int(n), float(start_in), float(rate)

    def throttled(self, name: str, ceiling: float, pause_s: float) -> float:
        return float(self._throttled(keys=[rate_bucket(name)], args=[repr(float(ceiling)), repr(float(pause_s))]))

    def stop_for_day(self, name: str) -> None:
        self._stop(keys=[rate_bucket(name)])

    def resume(self, names: list[str]) -> list[str]:
        """Lifts the day's quota stop of these buckets (a rerun probes its relays again): the
        names that were stopped."""
        return [n for n in names if self.r.hdel(rate_bucket(n), "stopped")]


def snapshot(r: redis.Redis, limit: int = 200) -> dict[str, dict]:
    """Every relay's and domain's rate now, its ceiling, throttle replies and quota state on this
    Redis (status, the live page): a few keys, one per relay and per paced domain. `r` decodes
    its replies (redis_client)."""
    names = sorted(r.scan_iter(RATE_PREFIX + "*", count=100))[:limit]
    seconds, micros = r.time()
    now, day = seconds + micros / 1e6, str(seconds // 86400)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    shown = {}
    for name, h in zip(names, pipe.execute()):
        ceiling = float(h.get("ceiling", 0))
        rate = min(ceiling, float(h.get("rate", 0)) + (now - float(h.get("at", now))) * ceiling * RECOVERY)
        shown[name.removeprefix(RATE_PREFIX)] = {
            "rate_now": round(rate, 1), "ceiling": ceiling,
            "throttles": int(h.get("throttles", 0)), "cuts": int(h.get("cuts", 0)),
            "sent_today": int(h.get("sent", 0)) if h.get("day") == day else 0,
            "quota_stopped": h.get("stopped") == day, "quota_replies": int(h.get("quota_replies", 0))}
    return shown
