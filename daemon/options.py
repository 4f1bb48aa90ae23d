"""Command-line options declared on dataclass fields, and everything generated from them.

A configuration dataclass of kvswap declares each of its options once, as a
field made by :func:`option`: the field's default is the option's default, and
its metadata carries the flag, the help text, how to parse the flag's text and
which values are allowed.  From that one declaration this module generates

* the argparse arguments (:func:`add_options`), with the default shown in the
  help, grouped under the docstring heading of the class that declares them;
* the config object back from parsed arguments (:func:`from_args`);
* the command line that reproduces a config (:func:`to_argv`), which is how
  the launcher starts ``kvswapd`` with exactly its own options;
* the validation of a config built in Python (:class:`Options` runs it in
  ``__post_init__``), with the same messages argparse prints;
* the markdown flag tables of ``docs/operations.md`` (:func:`markdown_table`).

So a default, a help text or an allowed range cannot drift between
``kvswapd``, ``kvswap launch`` and the Python API: there is no second copy.

A field without :func:`option` metadata is configuration only Python can set
(e.g. the supervisor's back-off).  A field made by :func:`nested` holds another
options dataclass whose flags are added to the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator

# A check looks at a parsed value and says what is wrong with it (completing
# "--flag ..."), or returns None when the value is allowed.
Check = Callable[[Any], "str | None"]

# What a field of a given parse function must hold when set from Python, and its name.
_EXPECTS: dict[Callable[[str], Any], tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"), float: ((int, float), "a number"), str: ((str,), "a string")}
_NO_CONST: Any = object()  # Option.const of an option whose flag always takes a value


@dataclass(frozen=True)
class Option:
    """How one field appears on the command line."""

    flag: str  # "--host-blocks"; for a boolean that defaults to True, the "--no-x" that clears it
    help: str  # argparse help text (a literal % is written %%)
    parse: Callable[[str], Any] = str  # flag text -> value
    check: Check | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    const: Any = _NO_CONST  # the value of the flag given without text (nargs="?")
    default_text: str | None = None  # how the default reads in help and docs, if not str(default)
    format: Callable[[Any], str] = str  # value -> flag text, the inverse of parse


def option(default: Any = MISSING, *, flag: str, help: str, **kw: Any) -> Any:
    """A dataclass field that is also a command-line option (keywords: see :class:`Option`).

    Without ``default`` the option is required."""
    return dataclasses.field(default=default, metadata={"option": Option(flag, help, **kw)})


def nested(cls: type) -> Any:
    """A field holding an options dataclass whose flags join the parent's parser."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls})


# ------------------------------------------------------------------ checks

def at_least(low: int) -> Check:
    return lambda v: None if v >= low else f"must be >= {low}, got {v}"


def between(low: int, high: int) -> Check:
    return lambda v: None if low <= v <= high else f"must be in [{low}, {high}], got {v}"


def positive(v: float) -> str | None:
    # `not v > 0` also refuses NaN.
    return None if v > 0 else f"must be > 0, got {v}"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v}"


# ------------------------------------------------------------------ validation

class Options:
    """Base of every options dataclass: construction validates each option's value.

    The checks are the ones argparse applies to flags, so a config built in
    Python is refused with the same message naming the same flag.  Subclasses
    that relate two options extend ``__post_init__`` (calling this one first)."""

    def __post_init__(self) -> None:
        for f, opt in _options(type(self)):
            problem = _problem(f, opt, getattr(self, f.name))
            if problem:
                raise ValueError(f"{opt.flag} {problem}")


def _problem(f: dataclasses.Field, opt: Option, value: Any) -> str | None:
    if _is_flag(f):
        return None if isinstance(value, bool) else f"must be True or False, got {value!r}"
    if value is None and f.default is None:
        return None
    if opt.parse in _EXPECTS:
        types, name = _EXPECTS[opt.parse]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"must be {name}, got {value!r}"
    if opt.choices is not None and value not in opt.choices:
        return f"must be one of {', '.join(map(str, opt.choices))}, got {value!r}"
    return opt.check(value) if opt.check is not None else None


def _options(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is not None:
            yield f, opt


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _is_flag(f: dataclasses.Field) -> bool:
    """A boolean option: present or absent, no value."""
    return isinstance(f.default, bool)


def default_text(f: dataclasses.Field, opt: Option) -> str:
    """The default as help and docs show it."""
    if opt.default_text is not None:
        return opt.default_text
    if _default(f) is MISSING:
        return "required"
    if _is_flag(f):
        return "off"
    return str(_default(f))


def declared_in(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` itself declares (not those it inherits)."""
    own = cls.__dict__.get("__annotations__", {})
    return [f for f in dataclasses.fields(cls) if f.name in own]


# ------------------------------------------------------------------ argparse

def value_type(parse: Callable[[str], Any], check: Check | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: ``parse`` the text, then refuse what ``check`` complains
    about; argparse prints the complaint after the flag's name and exits 2."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, TypeError) as exc:
            if parse in _EXPECTS:
                raise argparse.ArgumentTypeError(
                    f"expects {_EXPECTS[parse][1]}, got {text!r}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None
        problem = check(value) if check is not None else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return convert


def _metavar(f: dataclasses.Field, opt: Option) -> str | None:
    """What the help shows for the flag's value (None: argparse lists the choices)."""
    if opt.metavar is not None or opt.choices is not None:
        return opt.metavar
    return {int: "N", float: "SECONDS"}.get(opt.parse, f.name.upper())


def add_options(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add every option of ``cls`` (and of its nested options) to ``parser``.

    Options are grouped by the class that declares them, under the first line
    of its docstring, base classes first."""
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or not declared_in(klass):
            continue
        group = parser.add_argument_group((klass.__doc__ or klass.__name__).strip().splitlines()[0])
        for f in declared_in(klass):
            if "nested" in f.metadata:
                add_options(parser, f.metadata["nested"], f"{prefix}{f.name}.")
                continue
            opt = f.metadata.get("option")
            if opt is None:
                continue
            dest = prefix + f.name
            default = _default(f)
            shown = "(required)" if default is MISSING else f"(default: {default_text(f, opt)})"
            kw: dict[str, Any] = {"dest": dest,
                                  "help": f"{opt.help} {shown.replace('%', '%%')}"}
            if _is_flag(f):
                kw["action"] = "store_false" if default else "store_true"
            else:
                # Choices are left to argparse, whose message lists them.
                kw.update(type=value_type(opt.parse, opt.check), metavar=_metavar(f, opt))
                if opt.choices is not None:
                    kw["choices"] = opt.choices
                if opt.const is not _NO_CONST:
                    kw.update(nargs="?", const=opt.const)
                if default is MISSING:
                    kw["required"] = True
                else:
                    kw["default"] = default
            group.add_argument(opt.flag, **kw)


def from_args(cls: type, args: argparse.Namespace, prefix: str = "") -> Any:
    """The ``cls`` that parsed ``args`` describe (ValueError if options contradict)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            values[f.name] = from_args(f.metadata["nested"], args, f"{prefix}{f.name}.")
        elif "option" in f.metadata:
            values[f.name] = getattr(args, prefix + f.name)
    return cls(**values)


def parse_config(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace) -> Any:
    """:func:`from_args`, turning a contradiction between options into an argparse error
    (usage, message, exit status 2), like any other bad flag."""
    try:
        return from_args(cls, args)
    except ValueError as exc:
        parser.error(str(exc))


def to_argv(cfg: Any) -> list[str]:
    """Flags that parse back to ``cfg``: required options and every option whose
    value differs from its default (a default needs no flag, both sides share it)."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        if "nested" in f.metadata:
            argv += to_argv(getattr(cfg, f.name))
            continue
        opt = f.metadata.get("option")
        if opt is None:
            continue
        value = getattr(cfg, f.name)
        default = _default(f)
        if default is not MISSING and value == default:
            continue
        if _is_flag(f):
            argv.append(opt.flag)
        elif value is None:
            raise ValueError(f"{opt.flag} cannot be set back to None on a command line")
        elif opt.const is not _NO_CONST and value == opt.const:
            argv.append(opt.flag)
        else:
            # One token, so a value that starts with "-" is not taken for a flag.
            argv.append(f"{opt.flag}={opt.format(value)}")
    return argv


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default (or that it is required) after its help.

    Options made by :func:`option` carry theirs already; for hand-written
    arguments this adds ``(default: …)`` (``none`` for None), ``(default: off)``
    for a flag without a value, or ``(required)``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text  # positionals, --help, --version
        if "(default" in text or "(required)" in text:
            return text
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0:
            return f"{text} (default: off)"
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


# ------------------------------------------------------------------ docs

def markdown_table(classes: list[type], commands: Callable[[type], str], prefix: str = "") -> str:
    """One markdown row per option the given classes declare (not inherit): flag,
    the commands that take it (``commands(declaring class)``), the dataclass field
    that holds it, default, meaning."""
    rows = ["| flag | taken by | field | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for cls in classes:
        for f in declared_in(cls):
            if "nested" in f.metadata:
                inner = markdown_table([f.metadata["nested"]], commands, f"{prefix}{f.name}.")
                rows += inner.splitlines()[2:]
                continue
            opt = f.metadata.get("option")
            if opt is None:
                continue
            syntax = opt.flag
            if not _is_flag(f):
                value = _metavar(f, opt) or "{" + ",".join(map(str, opt.choices)) + "}"
                syntax += f" [{value}]" if opt.const is not _NO_CONST else f" {value}"
            # "<" escaped: markdown would take <ns> for an HTML tag and hide it.
            text = [default_text(f, opt), opt.help.replace("%%", "%")]
            cells = [f"`{syntax}`", commands(cls), f"`{prefix}{f.name}`",
                     *(t.replace("<", "\\<") for t in text)]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
