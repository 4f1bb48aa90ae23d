"""The options of storage URLs (``...?name=value&...``), parsed alike by every backend's
``from_url``: one parser per option, and a typo, a repeat or a bad value is a
ValueError naming the URL and the option, never silently ignored.  Byte sizes use
:func:`kvswap.daemon.options.parse_size`, so the sizes of flags and of URLs read
alike."""

from __future__ import annotations

import urllib.parse
from typing import Callable, Mapping, TypeVar

from kvswap.client.protocol import MAX_SECONDS


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("want 1/0, true/false, yes/no or on/off")


MIN_SECONDS = 0.001  # the shortest timeout a URL may give (see parse_seconds)


def parse_seconds(text: str) -> float:
    """A timeout, 1 ms to 366 days (``MAX_SECONDS``, every kvswap duration's bound): under
    1 ms no answer comes in time (sockets wait in whole milliseconds), so every call
    would time out; a far longer one overflows the waits it is given to."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("want a number of seconds") from None
    if not MIN_SECONDS <= value <= MAX_SECONDS:  # also refuses nan
        raise ValueError(f"want {MIN_SECONDS:g} to {MAX_SECONDS:.0f} seconds: a shorter "
                         "timeout fails every call, a longer one overflows the waits")
    return value


def parse_count(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("want a non-negative integer")
    return int(text)


T = TypeVar("T")


def url_options(url: str, query: str, parsers: Mapping[str, Callable[[str], T]]) -> dict[str, T]:
    """Parse ``query`` with one parser per known option; ValueError naming the URL for an
    unknown, repeated or unparsable option (a typo must not be silently ignored)."""
    out: dict[str, T] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in parsers:
            raise ValueError(f"storage URL {url!r}: unknown option {key!r} "
                             f"(known: {', '.join(sorted(parsers))})")
        if key in out:
            raise ValueError(f"storage URL {url!r}: option {key!r} given twice")
        try:
            out[key] = parsers[key](value)
        except ValueError as exc:
            raise ValueError(f"storage URL {url!r}: option {key}={value!r}: {exc}") from None
    return out
