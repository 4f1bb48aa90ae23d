"""Every `kvswap` / `kvswapd` command the docs show runs with --help, and every flag it
uses is one the command takes: a removed or renamed flag fails here, not a reader."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvswap.daemon import cli
from kvswap.daemon import main as kvswapd

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:\$ )?(kvswapd|kvswap|scripts/launch)(?:\s|$)")
OUTPUT = re.compile(r"^kvswapd?( \w+)?: ")  # what a command prints: "kvswap launch: [200 ..."
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def documented_commands(text: str) -> list[str]:
    """Commands in fenced code blocks (continued lines joined, comments dropped) and in
    inline code spans."""
    found = []
    for block in FENCE.findall(text):
        pending = ""
        for line in block.splitlines()[1:-1]:
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            line = line.split(" #")[0].strip()
            if COMMAND.match(line) and not OUTPUT.match(line):
                found.append(line)
    for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", text)):
        if COMMAND.match(span):
            found.append(span)
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _resolve(command: str) -> tuple[object, list[str], argparse.ArgumentParser, list[str]]:
    """(main, subcommand path, its parser, the flags the command uses)."""
    tokens = command.removeprefix("$ ").split()
    if tokens[0] == "kvswapd":
        main, parser = kvswapd.main, kvswapd.build_parser()
    else:
        main, parser = cli.main, cli.build_parser()
    rest = tokens[1:]
    path: list[str] = []
    if tokens[0] == "scripts/launch":  # the launcher wrapper: kvswap launch
        path, parser = ["launch"], _subparsers(parser)["launch"]
    while rest and rest[0] in _subparsers(parser):
        path.append(rest[0])
        parser = _subparsers(parser)[rest.pop(0)]
    flags = [t.strip("[],").split("=")[0] for t in rest]
    return main, path, parser, [f.strip("[]") for f in flags if f.startswith("--")]


CASES = [(doc.name, command) for doc in DOCS for command in documented_commands(doc.read_text())]


def test_the_docs_show_commands():
    # a change to how commands are written in the docs must not empty this check
    operations = [c for doc, c in CASES if doc == "operations.md"]
    assert len(operations) >= 20
    assert any(c.startswith("$ kvswap launch") for c in operations)
    assert any(c.startswith("kvswapd ") for c in operations)


@pytest.mark.parametrize("doc, command", CASES)
def test_documented_command_runs_with_help(doc, command, capsys):
    main, path, parser, flags = _resolve(command)
    with pytest.raises(SystemExit) as ei:
        main([*path, "--help"])
    assert ei.value.code == 0, f"{doc}: {command}"
    assert capsys.readouterr().out.startswith("usage:")
    unknown = [f for f in flags if f not in parser._option_string_actions]
    assert not unknown, f"{doc}: `{command}` uses {unknown}, which " \
                        f"`{' '.join(['kvswap', *path])}` does not take"
