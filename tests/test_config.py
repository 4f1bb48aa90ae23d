"""Options declared once: help and defaults of every flag, the launcher's kvswapd
command line, up-front validation, the generated docs tables, --version."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import kvswap.client
from kvswap.daemon import cli
from kvswap.daemon import main as kvswapd
from kvswap.daemon.config import (
    DaemonConfig,
    DaemonOptions,
    LaunchConfig,
    NamespaceOptions,
    fill_generated,
)
from kvswap.daemon.launcher import Launcher
from kvswap.daemon.options import from_args
from kvswap.daemon.supervisor import SupervisorConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"


# ------------------------------------------------------------------ help

def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(argv prefix, parser) of the command and of every subcommand, recursively."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def _help_entries(text: str) -> dict[str, str]:
    """Option string -> its help text, read from argparse's --help output."""
    entries: list[list[str]] = []  # [invocation, help] per option
    open_entry = False
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, help_start = line.strip().partition("  ")
            entries.append([invocation, help_start.strip()])
            open_entry = True
        elif open_entry and line.startswith("   "):
            entries[-1][1] += " " + line.strip()
        else:
            open_entry = False
    out = {}
    for invocation, help_text in entries:
        for spelling in invocation.split(", "):
            out[spelling.split()[0]] = " ".join(help_text.split())
    return out


def _all_help(capsys, main, parser):
    for path, sub in _commands(parser):
        with pytest.raises(SystemExit) as ei:
            main([*path, "--help"])
        assert ei.value.code == 0
        yield path, sub, _help_entries(capsys.readouterr().out)


@pytest.mark.parametrize("which", ["kvswap", "kvswapd"])
def test_every_option_has_help_and_shows_its_default(which, capsys):
    main, parser = ((cli.main, cli.build_parser()) if which == "kvswap"
                    else (kvswapd.main, kvswapd.build_parser()))
    checked = 0
    for path, sub, entries in _all_help(capsys, main, parser):
        for action in sub._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue  # subcommand choices, --help, --version
            flag = action.option_strings[-1]
            where = f"{which} {' '.join(path)} {flag}"
            assert flag in entries, f"{where} is missing from --help"
            text = entries[flag]
            m = re.fullmatch(r"(.*\S)\s+\((default: (.+)|required(, here or in --config)?)\)",
                             text)
            assert m, f"{where}: help {text!r} does not end with its default or (required)"
            assert m.group(1).strip(), f"{where} has no help text"
            # An option a --config file may give is required after the file is read.
            assert (action.required or m.group(4) is not None) == \
                m.group(2).startswith("required"), where
            if isinstance(action.default, (int, float, str)) and action.nargs != 0 \
                    and not isinstance(action.default, bool):
                assert str(action.default) in m.group(3), f"{where}: default not shown: {text!r}"
            checked += 1
    assert checked >= (60 if which == "kvswap" else 25)


def test_launch_help_tells_the_two_stale_thresholds_apart(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    entries = _help_entries(capsys.readouterr().out)
    assert "aborts the barriers" in entries["--stale-after"]
    assert "(default: 5.0)" in entries["--stale-after"]
    assert "killed (SIGKILL) and restarted" in entries["--restart-stale-after"]
    assert "(default: 10.0)" in entries["--restart-stale-after"]
    assert "--daemon-args" not in entries


# ------------------------------------------------------------------ launcher -> kvswapd

# A value different from the default for every rank-independent kvswapd option,
# with the awkward ones a command line must survive (a leading '-', spaces, '=').
NON_DEFAULT = {
    "run_root": "/tmp/kvs config/root",
    "backend": "cuda",
    "host_blocks": 77,
    "demo_caches": "layers=2,heads=2",
    "attach_timeout_s": 12.5,
    "heartbeat_interval_s": 0.025,
    "stale_after_s": 2.0,
    "max_device_blocks": 1 << 16,
    "workers": 3,
    "merge": False,
    "max_merge_blocks": 17,
    "inline_max_bytes": 0,
    "orphan_timeout_s": 1e-3,
    "secret_file": "/tmp/my secret",
    "replay_window_s": 5.0,
    "storage_url": "file:///tmp/store?capacity_bytes=1G",
    "model_id": "-m llama=3",
    "model_version": "rev 7",
    "storage_timeout_s": 4.0,
    "drain_timeout_s": 6.0,
    "journal_records": 1000,
    "journal_mib": 4,
    "log_level": "DEBUG",
    "peer_transfer": "rdma",
    "peer_host": "10.0.0.7",
    "peer_timeout_s": 7.5,
}


def _parse_kvswapd(argv: list[str]) -> DaemonConfig:
    return from_args(DaemonConfig, kvswapd.build_parser().parse_args(argv))


# Options that exclude one of NON_DEFAULT's (--host-size sizes the pool instead of
# --host-blocks), with the value their own round trip uses.
ALTERNATIVES = {"host_size": 64 << 30}


def test_launcher_daemon_command_round_trips_to_an_equal_daemon_config():
    shared = {f.name for f in dataclasses.fields(DaemonOptions)} - {"namespace"}
    assert set(NON_DEFAULT) | set(ALTERNATIVES) == shared, \
        "give every kvswapd option a non-default test value"
    for name, value in NON_DEFAULT.items():
        assert value != next(f for f in dataclasses.fields(DaemonOptions)
                             if f.name == name).default, name
    launcher = Launcher(LaunchConfig(namespace="rt", tp=2, devices=[3, 5], tcp="127.0.0.1:7100",
                                     **NON_DEFAULT))
    for rank in range(2):
        cmd = launcher.daemon_command(rank)
        assert cmd[:3] == [sys.executable, "-m", "kvswap.daemon"]
        parsed = _parse_kvswapd(cmd[3:])
        assert parsed == DaemonConfig(namespace="rt", rank=rank, tp_size=2, device=[3, 5][rank],
                                      listen_tcp=f"tcp://127.0.0.1:{7100 + rank}", **NON_DEFAULT)
        assert parsed == launcher.daemon_config(rank)


def test_host_size_round_trips_instead_of_host_blocks():
    options = {**{k: v for k, v in NON_DEFAULT.items() if k != "host_blocks"}, **ALTERNATIVES}
    launcher = Launcher(LaunchConfig(namespace="rt", tp=1, **options))
    cmd = launcher.daemon_command(0)
    assert f"--host-size={64 << 30}" in cmd and not any("--host-blocks" in a for a in cmd)
    parsed = _parse_kvswapd(cmd[3:])
    assert parsed == launcher.daemon_config(0)
    assert (parsed.host_size, parsed.host_blocks, parsed.pool_blocks) == (64 << 30, None, None)


def test_default_daemon_command_is_short_and_round_trips(run_root):
    launcher = Launcher(LaunchConfig(namespace="rt", tp=1, run_root=run_root))
    cmd = launcher.daemon_command(0)
    assert cmd[3:] == ["--namespace=rt", f"--run-root={run_root}", "--rank=0", "--tp=1"]
    assert _parse_kvswapd(cmd[3:]) == DaemonConfig(namespace="rt", run_root=run_root,
                                                   rank=0, tp_size=1)


def _launch_config(argv: list[str]) -> LaunchConfig:
    args = cli.build_parser().parse_args(["launch", *argv])
    return args.make_config(args)


def test_kvswapd_options_are_first_class_launch_flags():
    cfg = _launch_config(["--namespace", "ns", "--tp", "2", "--workers", "4", "--no-merge",
                          "--orphan-timeout", "1", "--stale-after", "7", "--restart-stale-after",
                          "2.5", "--max-restarts", "0", "--log-level", "debug",
                          "--max-device-blocks", "65536"])
    assert cfg == LaunchConfig(namespace="ns", tp=2, workers=4, merge=False, orphan_timeout_s=1.0,
                               stale_after_s=7.0, log_level="DEBUG", max_device_blocks=1 << 16,
                               supervision=SupervisorConfig(max_retries=0, stale_after_s=2.5))
    daemon = Launcher(cfg).daemon_config(1)
    assert (daemon.workers, daemon.merge, daemon.orphan_timeout_s, daemon.stale_after_s,
            daemon.log_level, daemon.max_device_blocks) == (4, False, 1.0, 7.0, "DEBUG", 1 << 16)


# ------------------------------------------------------------------ validation

BAD = [
    ("kvswapd", ["--log-level", "LOUD"], ["--log-level", "'DEBUG'", "'CRITICAL'"]),
    ("kvswapd", ["--rank", "-1"], ["--rank", "must be >= 0"]),
    ("kvswapd", ["--listen-tcp", "http://h:1"], ["--listen-tcp", "tcp://HOST:PORT"]),
    ("launch", ["--workers", "0"], ["--workers", "must be in [1, 256]", "got 0"]),
    # a host out of threads failed every daemon, and the launcher's teardown with them
    ("launch", ["--workers", "100000"], ["--workers", "must be in [1, 256]", "got 100000"]),
    # every nanosecond: an idle daemon burnt a third of a core
    ("kvswapd", ["--heartbeat-interval", "1e-9"], ["--heartbeat-interval", "at least 0.01"]),
    # under the worker's heartbeat: a live engine's namespace was torn down
    ("launch", ["--engine-timeout", "0.4"], ["--engine-timeout", "0 (never) or at least 1"]),
    ("launch", ["--host-blocks", "many"], ["--host-blocks", "expects an integer, got 'many'"]),
    ("launch", ["--ready-timeout", "0"], ["--ready-timeout", "must be > 0"]),
    ("launch", ["--drain-timeout", "nan"], ["--drain-timeout", "must be > 0"]),
    ("launch", ["--engine-timeout", "-1"], ["--engine-timeout", "must be >= 0"]),
    ("launch", ["--max-restarts", "-1"], ["--max-restarts", "must be >= 0"]),
    ("launch", ["--restart-stale-after", "0"], ["--restart-stale-after", "must be > 0"]),
    ("launch", ["--tp", "1025"], ["--tp", "must be in [1, 1024]"]),
    ("launch", ["--backend", "tpu"], ["--backend", "'host'", "'cuda'"]),
    ("launch", ["--namespace", "a/b"], ["--namespace", "[A-Za-z0-9_-]"]),
    ("launch", ["--demo-caches", "layers=x"], ["--demo-caches", "layers must be an int"]),
    ("launch", ["--devices", "0,x"], ["--devices", "like 0,1"]),
    ("launch", ["--tcp", "nohost"], ["--tcp", "HOST:BASEPORT"]),
    ("launch", ["--tcp", "127.0.0.1:7100"], ["--tcp needs --secret-file"]),
    ("launch", ["--devices", "0"], ["--devices names 1 devices for --tp 2"]),
    ("launch", ["--daemon-args", "--workers 4"], ["unrecognized arguments: --daemon-args"]),
    ("launch", ["--host-size", "64GiB", "--host-blocks", "8"],
     ["--host-blocks and --host-size both size the host pool: give one"]),
    ("launch", ["--host-size", "1.5G"], ["--host-size", "like 4096, 512MiB or 64GiB"]),
    ("launch", ["--storage", "ftp://x/y"], ["--storage", "unknown scheme 'ftp'", "file://"]),
    ("launch", ["--model-version", "x|tp=2"], ["--model-version", "contains '|'"]),
    ("launch", ["--run-root", "/tmp/" + "r" * 120], ["too long for an ipc:// socket path"]),
    ("launch", ["--config", "/nonexistent/kvswap.toml"], ["--config", "cannot read it"]),
    ("status", ["--namespace", "a b"], ["--namespace", "[A-Za-z0-9_-]"]),
    ("status", ["--run-root", "/tmp/" + "r" * 120], ["--run-root"]),
    ("metrics", ["--namespace", "a b"], ["--namespace", "[A-Za-z0-9_-]"]),
    ("status", ["--interval", "0"], ["--interval", "must be > 0"]),
    ("metrics", ["--port", "70000"], ["--port", "must be in [0, 65535]"]),
    ("demo", ["--threads", "0"], ["--threads", "must be >= 1"]),
    ("bench", ["tasks", "--tp", "0"], ["--tp", "must be in [1, 1024]"]),
    # durations past a year: inf passed "> 0", then overflowed a timer or never came
    ("launch", ["--replay-window", "inf"], ["--replay-window", "at most 31622400 seconds"]),
    ("launch", ["--stop-timeout", "1e300"], ["--stop-timeout", "at most 31622400 seconds"]),
    ("launch", ["--engine-timeout", "inf"], ["--engine-timeout", "must be >= 0 and at most"]),
    ("status", ["--interval", "1e10"], ["--interval", "at most 31622400 seconds"]),
    ("kvswapd", ["--heartbeat-interval", "3"],
     ["--heartbeat-interval 3 must be at most half of --stale-after 5", "lower"]),
    ("demo", ["--host-blocks", "3"], ["--host-blocks 3: fewer than --threads 4"]),
    ("demo", ["--layout", "blocks=2", "--threads", "3"],
     ["device blocks (--layout blocks=) 2: fewer than --threads 3"]),
    ("launch", ["--heartbeat-interval", "6", "--stale-after", "60"],
     ["--heartbeat-interval 6 must be at most half of --restart-stale-after 10",
      "is killed and restarted"]),
]


@pytest.mark.parametrize("command,argv,expected", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_values_exit_2_naming_the_flag_and_what_it_allows(command, argv, expected, capsys):
    base = {"kvswapd": ["--namespace", "ns", "--rank", "0", "--tp", "2"],
            "launch": ["launch", "--namespace", "ns", "--tp", "2"],
            "status": ["status", "--namespace", "ns"],
            "metrics": ["metrics", "--namespace", "ns", "--port", "0"],
            "demo": ["demo"], "bench": ["bench"]}[command]
    main = kvswapd.main if command == "kvswapd" else cli.main
    with pytest.raises(SystemExit) as ei:
        main(base + argv)  # the later of two same flags wins in argparse
    assert ei.value.code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize("cls,kw,message", [
    (LaunchConfig, {"workers": 0}, "--workers must be in [1, 256]"),
    (LaunchConfig, {"host_blocks": "8"}, "--host-blocks must be an integer, got '8'"),
    (LaunchConfig, {"demo_caches": 5}, "--demo-caches must be a string, got 5"),
    (LaunchConfig, {"merge": 0}, "--no-merge must be True or False, got 0"),
    (LaunchConfig, {"tcp": "127.0.0.1:65535", "secret_file": "/s"},
     "--tcp must be HOST:BASEPORT with BASEPORT from 1 to 65534"),
    (LaunchConfig, {"tcp": "127.0.0.1:65534", "secret_file": "/s"},  # rank 1 has no port
     "--tcp 127.0.0.1:65534: BASEPORT + --tp must be at most 65535"),
    (DaemonConfig, {"rank": 0, "log_level": "debug"}, "--log-level must be one of DEBUG, INFO"),
    (SupervisorConfig, {"max_retries": -1}, "--max-restarts must be >= 0, got -1"),
    (SupervisorConfig, {"backoff_s": float("nan")}, "SupervisorConfig.backoff_s must be >= 0"),
    (SupervisorConfig, {"backoff_s": "0.5"}, "SupervisorConfig.backoff_s must be a number"),
    (SupervisorConfig, {"backoff_s": 2.0, "backoff_max_s": 1.0},
     "backoff_max_s (1.0) must be at least backoff_s (2.0)"),
    (LaunchConfig, {"supervision": {}}, "LaunchConfig.supervision must be a SupervisorConfig"),
])
def test_configs_built_in_python_are_validated_the_same_way(cls, kw, message):
    base = {LaunchConfig: {"namespace": "ns", "tp": 2},
            DaemonConfig: {"namespace": "ns", "tp_size": 2}, SupervisorConfig: {}}[cls]
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**base, **kw)


# ------------------------------------------------------------------ docs, version

def test_operations_doc_flag_tables_equal_the_declarations():
    text = (DOCS / "operations.md").read_text()
    assert fill_generated(text) == text, (
        "docs/operations.md flag tables are stale: python -m kvswap.daemon.config "
        "docs/operations.md")
    for cls in (NamespaceOptions, DaemonConfig, LaunchConfig):  # every flag is in a table
        for action in (a for a in _parser_of(cls)._actions if a.option_strings[0] != "-h"):
            assert f"| `{action.option_strings[0]}" in text, action.option_strings[0]


def _parser_of(cls: type) -> argparse.ArgumentParser:
    from kvswap.daemon.options import add_options

    p = argparse.ArgumentParser()
    add_options(p, cls)
    return p


def test_version_of_both_commands_is_the_installed_distribution(capsys):
    installed = importlib.metadata.version("kvswap")
    assert kvswap.client.__version__ == installed
    for main, prog in ((cli.main, "kvswap"), (kvswapd.main, "kvswapd")):
        with pytest.raises(SystemExit) as ei:
            main(["--version"])
        assert ei.value.code == 0
        assert capsys.readouterr().out.strip() == f"{prog} {installed}"


# ------------------------------------------------------------------ --config FILE

def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvswap.toml"
    path.write_text(text, errors="surrogateescape")  # \udcff: the byte 0xff
    return str(path)


def test_config_file_keys_are_the_flags_and_flags_override_it(tmp_path):
    path = _toml(tmp_path, """
namespace = "fromfile"
tp = 2
host-size = "64GiB"
no-merge = true
demo-caches = true
devices = [3, 5]
log-level = "debug"
stale-after = 7
max-restarts = 0
ready-timeout = "30"
""")
    cfg = _launch_config(["--config", path, "--tp", "2", "--workers", "3",
                          "--ready-timeout", "45"])
    assert cfg == LaunchConfig(
        namespace="fromfile", tp=2, host_size=64 << 30, merge=False, demo_caches="",
        devices=[3, 5], log_level="DEBUG", stale_after_s=7.0, workers=3, ready_timeout_s=45.0,
        supervision=SupervisorConfig(max_retries=0))
    # a flag given on the command line wins over the file
    assert _launch_config(["--config", path, "--namespace", "flag"]).namespace == "flag"


@pytest.mark.parametrize("text, expected", [
    ("namespace = 'n'\ntp = 2\nhost-sise = '1G'\n",
     ["unknown key 'host-sise'", "did you mean 'host-size'?"]),
    ("namespace = 'n'\ntp = 2\nworkers = 0\n", ["workers = 0: must be in [1, 256]"]),
    ("namespace = 'n'\ntp = 2.5\n", ["tp = 2.5: must be an integer, got 2.5"]),
    ("namespace = 'n'\ntp = 2\nno-merge = 'yes'\n", ["no-merge = 'yes': want true or false"]),
    ("namespace = 'n'\ntp = 2\nstorage = 'ftp://x'\n", ["unknown scheme 'ftp'"]),
    ("namespace = 'n'\ntp = 2\nlog-level = 'loud'\n", ["log-level = 'loud'", "one of DEBUG"]),
    ("namespace = 'n'\ntp = [\n", ["not valid TOML"]),
    ("namespace = 'n'\ntp = 2 # \udcff\n", ["not valid TOML", "can't decode byte 0xff"]),
    ("tp = 2\n", ["the following arguments are required: --namespace"]),
])
def test_bad_config_file_exits_2_naming_the_key(tmp_path, capsys, text, expected):
    path = _toml(tmp_path, text)
    with pytest.raises(SystemExit) as ei:
        cli.main(["launch", "--config", path])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path}" in err or "required" in err
    for part in expected:
        assert part in err, err


def test_options_missing_from_flags_and_file_are_still_required(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["launch", "--namespace", "n"])
    assert ei.value.code == 2
    assert "the following arguments are required: --tp" in capsys.readouterr().err


def test_the_package_exports_resolve_and_a_daemon_imports_none_it_does_not_use():
    """``kvswap.client`` imports its names on first use: each exported name is the
    defining module's object, and a daemon's start imports neither the engine-side
    classes nor the package metadata (a tenth of a second of every daemon start)."""
    import subprocess

    where = {"ErrorCode": "errors", "TransferClient": "transfer_client", "HostCache": "host_cache",
             "PROTOCOL_VERSION": "protocol", "RankState": "signals", "block_hashes": "block_keys"}
    for name in kvswap.client.__all__:
        assert getattr(kvswap.client, name) is not None
    for name, module in where.items():
        defined = getattr(importlib.import_module(f"kvswap.client.{module}"), name)
        assert getattr(kvswap.client, name) is defined
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvswap.client.nope  # noqa: B018
    # submodules as attributes of the package, as docs/engines.md spells them
    probe = ("import kvswap.client as c; print(c.protocol.MAX_HEADER_BYTES, c.errors.ErrorCode.OK, "
             "c.signals.RankSlot.CONN_REFUSED, c.transfer_client.WINDOW)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == [str(kvswap.client.protocol.MAX_HEADER_BYTES), "0", "17",
                   str(kvswap.client.transfer_client.WINDOW)]
    probe = ("import sys, kvswap.daemon.main; print(sorted(m for m in sys.modules if m in "
             "('kvswap.client.transfer_client', 'kvswap.client.host_cache', "
             "'kvswap.client.cache_worker', 'importlib.metadata')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]", out
