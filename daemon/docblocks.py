"""Generated blocks of the markdown docs: the one way a doc holds text written by code.

A block is everything between two marker lines::

    <!-- generated: NAME -->
    ... written by code: replaced whole on every regeneration ...
    <!-- end: NAME -->

Everything outside the blocks is hand-written and never touched.  Users:
``docs/operations.md`` (the flag tables, :func:`kvswap.daemon.config.fill_generated`)
and ``docs/benchmarks.md`` (``kvswap bench all --markdown``).

The markers are parsed strictly (each ``generated`` line followed by its own
``end`` line before the next marker, each name once), because a lenient parse
of a hand-edited doc would silently swallow the prose between two blocks.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"^<!-- (generated|end): ([A-Za-z0-9_.-]+) -->$", re.M)


def begin_marker(name: str) -> str:
    return f"<!-- generated: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- end: {name} -->"


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def blocks(text: str) -> dict[str, tuple[int, int]]:
    """Each block of ``text``, in order: name -> (start, end) of its content, i.e.
    from the line after the ``generated`` marker to the start of the ``end`` marker.

    Raises ValueError naming the line of the first malformed marker."""
    found: dict[str, tuple[int, int]] = {}
    open_name, open_at, open_line = None, 0, 0
    for m in _MARKER.finditer(text):
        kind, name = m.group(1), m.group(2)
        line = _line_of(text, m.start())
        if kind == "generated":
            if open_name is not None:
                raise ValueError(f"line {line}: '{m.group(0)}' inside the block {open_name!r} "
                                 f"(opened on line {open_line}): close it first "
                                 f"with '{end_marker(open_name)}'")
            if name in found:
                raise ValueError(f"line {line}: a second block {name!r}: each name once")
            open_name, open_at, open_line = name, m.end() + 1, line
        else:
            if name != open_name:
                raise ValueError(f"line {line}: '{m.group(0)}' without '{begin_marker(name)}' "
                                 "before it")
            found[name] = (open_at, m.start())
            open_name = None
    if open_name is not None:
        raise ValueError(f"line {open_line}: block {open_name!r} has no "
                         f"'{end_marker(open_name)}' line after it")
    return found


def fill(text: str, contents: dict[str, str]) -> str:
    """``text`` with the content of each block named in ``contents`` replaced by
    ``contents[name]`` (a final newline is added).  Blocks not named are kept as they
    are; a name without a block is a ValueError, and then nothing is replaced."""
    spans = blocks(text)
    missing = [name for name in contents if name not in spans]
    if missing:
        raise ValueError(", ".join(f"no '{begin_marker(n)}' ... '{end_marker(n)}' block"
                                   for n in missing) + ": add the marker lines where the "
                                                       "generated text goes")
    out, pos = [], 0
    for name, (start, end) in spans.items():  # in document order
        if name in contents:
            out += [text[pos:start], contents[name].rstrip("\n") + "\n"]
            pos = end
    out.append(text[pos:])
    return "".join(out)
