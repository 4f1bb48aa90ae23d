"""Log rate limiting: first occurrence, then one line with a count per window."""

from __future__ import annotations

import logging

from kvswap.daemon import logs


def _record(msg, *args, level=logging.WARNING):
    return logging.LogRecord("kvswap.x", level, __file__, 1, msg, args, None)


def test_repeats_are_suppressed_then_counted(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    f = logs.RateLimitFilter(window_s=10)
    assert f.filter(_record("rejected %s %d: bad id", "evict", 1))
    # same event with other numbers: suppressed inside the window
    assert not any(f.filter(_record("rejected %s %d: bad id", "evict", i)) for i in range(2, 50))
    # a different event is not affected
    assert f.filter(_record("rejected %s %d: bad id", "load", 1))
    clock[0] += 11
    rec = _record("rejected %s %d: bad id", "evict", 99)
    assert f.filter(rec)
    assert "repeated 48 more times" in rec.getMessage()
    # the count restarts after it was reported
    rec2 = _record("rejected %s %d: bad id", "evict", 100)
    assert not f.filter(rec2)


def test_levels_are_separate_events():
    f = logs.RateLimitFilter(window_s=10)
    assert f.filter(_record("x", level=logging.INFO))
    assert f.filter(_record("x", level=logging.ERROR))
