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
* the markdown flag tables of ``docs/operations.md`` (:func:`markdown_table`);
* the reading of a TOML config file (``kvswap launch --config FILE``) whose
  keys are the flags without their leading dashes (:func:`read_config_file`),
  checked like the flags; a flag given on the command line overrides the file.

So a default, a help text or an allowed range cannot drift between
``kvswapd``, ``kvswap launch`` and the Python API: there is no second copy.

A field without :func:`option` metadata is configuration only Python can set
(e.g. the supervisor's back-off).  A field made by :func:`nested` holds another
options dataclass whose flags are added to the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator

from kvswap.client.protocol import MAX_SECONDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (a dependency there only)
    import tomli as tomllib

# A check looks at a parsed value and says what is wrong with it (completing
# "--flag ..."), or returns None when the value is allowed.
Check = Callable[[Any], "str | None"]

# What a field of a given parse function must hold when set from Python, and its name.
_EXPECTS: dict[Callable[[str], Any], tuple[tuple[type, ...], str]] = {
    int: ((int,), "an integer"), float: ((int, float), "a number"), str: ((str,), "a string")}
_NO_CONST: Any = object()  # Option.const of an option whose flag always takes a value


class _Unset:
    """The argparse default of an option that may come from a config file: tells
    "not on the command line" apart from any value (:func:`from_args`)."""

    def __repr__(self) -> str:
        return "<not given>"


UNSET: Any = _Unset()


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


def non_negative(v: float) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v}"


def seconds(v: float) -> str | None:
    """A duration: > 0 and at most :data:`MAX_SECONDS`.  The comparisons also refuse
    NaN; the bound refuses ``inf`` and ``1e300``, which pass ``> 0`` but overflow the
    integer nanoseconds and milliseconds timers are kept in, or leave a deadline that
    never comes (a staged stop that never escalates)."""
    return None if 0 < v <= MAX_SECONDS else f"must be > 0 and {_AT_MOST}, got {v}"


def seconds_or_zero(v: float) -> str | None:
    """A duration where 0 means "off": >= 0 and at most :data:`MAX_SECONDS`."""
    return None if 0 <= v <= MAX_SECONDS else f"must be >= 0 and {_AT_MOST}, got {v}"


_AT_MOST = f"at most {MAX_SECONDS:.0f} seconds (366 days)"


# ------------------------------------------------------------------ byte sizes

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A positive byte count: an integer with an optional binary unit, ``K``/``KiB``,
    ``M``/``MiB``, ``G``/``GiB``, ``T``/``TiB`` (``64GiB``, ``500G``, ``4096``).

    Every unit is a power of two, as ``free -g`` and ``df -h`` count; ``64GB``
    reads as 64 GiB too, rather than as a second meaning of the same letters."""
    m = _SIZE.fullmatch(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"want a positive byte count like 4096, 512MiB or 64GiB, got {text!r}")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def format_size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.50 GiB``)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
        for f in dataclasses.fields(self):
            cls = f.metadata.get("nested")
            if cls is not None and not isinstance(getattr(self, f.name), cls):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a {cls.__name__}, "
                                 f"got {getattr(self, f.name)!r:.60}")


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


def add_options(parser: argparse.ArgumentParser, cls: type, prefix: str = "", *,
                config_file: bool = False) -> None:
    """Add every option of ``cls`` (and of its nested options) to ``parser``.

    Options are grouped by the class that declares them, under the first line
    of its docstring, base classes first.  With ``config_file``, the parser also
    takes ``--config FILE`` (:func:`read_config_file`); then no option is
    required on the command line and each one not given parses as :data:`UNSET`,
    so :func:`parse_config` can take it from the file or the declared default."""
    if config_file and not prefix:
        parser.add_argument(
            "--config", metavar="FILE", default=None,
            help="TOML file of options: each key is a flag of this command without its "
                 "leading dashes (host-size = \"64GiB\", tp = 2, no-merge = true); a flag "
                 "given here overrides the file")
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or not declared_in(klass):
            continue
        group = parser.add_argument_group((klass.__doc__ or klass.__name__).strip().splitlines()[0])
        for f in declared_in(klass):
            if "nested" in f.metadata:
                add_options(parser, f.metadata["nested"], f"{prefix}{f.name}.",
                            config_file=config_file)
                continue
            opt = f.metadata.get("option")
            if opt is None:
                continue
            dest = prefix + f.name
            default = _default(f)
            shown = ("(required, here or in --config)" if config_file else "(required)") \
                if default is MISSING else f"(default: {default_text(f, opt)})"
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
            if config_file:
                kw.pop("required", None)
                kw["default"] = UNSET
            group.add_argument(opt.flag, **kw)


def from_args(cls: type, args: argparse.Namespace, prefix: str = "",
              file_values: dict[str, Any] | None = None) -> Any:
    """The ``cls`` that parsed ``args`` describe (ValueError if options contradict or a
    required one is missing).  An option the command line did not give (:data:`UNSET`)
    takes its value from ``file_values`` (argparse dest -> value), else its default."""
    file_values = file_values or {}
    values: dict[str, Any] = {}
    missing: list[str] = []
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            values[f.name] = from_args(f.metadata["nested"], args, f"{prefix}{f.name}.",
                                       file_values)
        elif "option" in f.metadata:
            value = getattr(args, prefix + f.name)
            if value is UNSET:
                value = file_values.get(prefix + f.name, _default(f))
            if value is MISSING:
                missing.append(f.metadata["option"].flag)
            values[f.name] = value
    if missing:
        raise ValueError(f"the following arguments are required: {', '.join(missing)}")
    return cls(**values)


def parse_config(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace) -> Any:
    """:func:`from_args`, with the ``--config`` file if the parser takes one and it was
    given, turning a contradiction between options, a missing one or a bad file into an
    argparse error (usage, message, exit status 2), like any other bad flag."""
    try:
        path = getattr(args, "config", None)
        return from_args(cls, args, file_values=read_config_file(path, cls) if path else None)
    except ValueError as exc:
        parser.error(str(exc))


# ------------------------------------------------------------------ config files

def config_keys(cls: type, prefix: str = "") -> dict[str, tuple[str, dataclasses.Field, Option]]:
    """Config-file key (the flag without its leading dashes) -> (argparse dest, field,
    option), for every option of ``cls`` and of its nested options."""
    keys: dict[str, tuple[str, dataclasses.Field, Option]] = {}
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            keys.update(config_keys(f.metadata["nested"], f"{prefix}{f.name}."))
        elif "option" in f.metadata:
            opt = f.metadata["option"]
            keys[opt.flag.lstrip("-")] = (prefix + f.name, f, opt)
    return keys


def _file_value(f: dataclasses.Field, opt: Option, value: Any) -> Any:
    """A config file's value for one option, as the option holds it; ValueError
    with what is wrong (the same checks as the flag's)."""
    if _is_flag(f):
        if not isinstance(value, bool):
            raise ValueError(f"want true or false, got {value!r}")
        # A flag that clears a default of True (--no-merge) stores the opposite.
        return not value if f.default else value
    if value is True and opt.const is not _NO_CONST:
        return opt.const  # the flag given without a value
    if isinstance(value, str) and opt.parse is not str:
        try:
            value = value_type(opt.parse)(value)  # the flag's text, parsed as on the command line
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
    try:
        problem = _problem(f, opt, value)
    except TypeError:
        problem = f"has the wrong type: {value!r}"
    if problem:
        raise ValueError(problem)
    return value


def read_config_file(path: str, cls: type) -> dict[str, Any]:
    """The options a TOML file sets, as argparse dest -> value.

    Every top-level key is one option of ``cls``, named by its flag without the
    leading dashes (``host-size = "64GiB"``, ``tp = 2``, ``no-merge = true``); a
    value is either the TOML type of the option (a number, a boolean, a list of
    ordinals for ``devices``) or the text the flag takes.  ValueError naming the
    file and the key for an unreadable file, an unknown key or a bad value."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8 text
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    keys = config_keys(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"--config {path}: unknown key {key!r}: keys are the flags "
                             f"without their leading dashes{hint}")
        dest, f, opt = keys[key]
        try:
            out[dest] = _file_value(f, opt, value)
        except ValueError as exc:
            raise ValueError(f"--config {path}: {key} = {value!r}: {exc}") from None
    return out


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


class VersionAction(argparse.Action):
    """``--version``: prints the program and kvswap's version, which is looked up only
    then (the package metadata lookup is a sizeable share of a daemon's start)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the program's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        from kvswap.client import __version__

        print(f"{parser.prog} {__version__}")  # to stdout, as argparse's own action does
        parser.exit()


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
