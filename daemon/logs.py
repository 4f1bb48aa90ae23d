"""Logging of every kvswap command: one line per event, one timestamp format,
repeats rate-limited.

Every line, from a daemon or from ``kvswap launch`` / ``demo`` / ``bench``, reads

    YYYY-MM-DD HH:MM:SS.mmm WHO LEVEL logger: message

with WHO ``rank<r>`` for a daemon and ``kvswap`` for the command itself, so
lines of the launcher and of its rank logs sort and grep alike.  The launcher
reads its ranks' logs back with :data:`LINE` (the same format, parsed).

A message template that repeats (e.g. the same malformed frame from a broken
client) is logged the first time, then at most once per ``window_s`` with a
count of what was suppressed, so a misbehaving peer cannot flood the disk.
"""

from __future__ import annotations

import logging
import re
import sys
import time

_DIGITS = re.compile(r"\d+")

# A log line as formatted by :func:`formatter`; groups time, who, level, logger, message.
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (\S+) "
                  r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")


def formatter(who: str) -> logging.Formatter:
    """The one line format of every kvswap log (module docstring); ``who`` is
    ``rank<r>`` for a daemon, ``kvswap`` for a command."""
    return logging.Formatter(f"%(asctime)s.%(msecs)03d {who} %(levelname)s %(name)s: %(message)s",
                             datefmt="%Y-%m-%d %H:%M:%S")


class RateLimitFilter(logging.Filter):
    def __init__(self, window_s: float = 10.0):
        super().__init__()
        self.window_s = window_s
        self._seen: dict[tuple[str, int], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # Same text up to numbers (ids, counts, timings) = same event.
        key = (_DIGITS.sub("#", record.getMessage()), record.levelno)
        now = time.monotonic()
        last = self._seen.get(key)
        if last is None:
            self._seen[key] = (now, 0)
            if len(self._seen) > 4096:  # bound memory against unbounded distinct templates
                self._seen.clear()
            return True
        t0, suppressed = last
        if now - t0 < self.window_s:
            self._seen[key] = (t0, suppressed + 1)
            return False
        self._seen[key] = (now, 0)
        if suppressed:
            record.msg = f"{record.msg} [repeated {suppressed} more times in {self.window_s:.0f}s]"
        return True


def setup_logging(rank: int, level: str = "INFO", window_s: float = 10.0) -> None:
    """A daemon's logging: its ``kvswap`` loggers to stderr (the rank's log file)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(f"rank{rank}"))
    handler.addFilter(RateLimitFilter(window_s))
    root = logging.getLogger("kvswap")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def setup_command_logging(level: int = logging.INFO) -> None:
    """A ``kvswap`` command's logging: every logger to stderr, in the daemons' format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter("kvswap"))
    logging.basicConfig(level=level, handlers=[handler])
