"""``kvswap``: launch a namespace, show its status, run the demo."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Protocol, TextIO

from kvswap.client.errors import KvswapError
from kvswap.client.monitor import format_json, format_table, read_status, transfer_rates
from kvswap.daemon import bench, bench_all
from kvswap.daemon.config import LaunchConfig, NamespaceOptions
from kvswap.daemon.demo import DemoConfig
from kvswap.daemon.logs import setup_command_logging
from kvswap.daemon.options import (
    HelpFormatter,
    VersionAction,
    add_options,
    between,
    format_size,
    parse_config,
    seconds,
    value_type,
)


# A foreground command's stop: Ctrl-C, kill, and the terminal closing (SIGHUP), which
# would otherwise end the process where it stands and leave the namespace behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _subcommand(sub: argparse._SubParsersAction, name: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=HelpFormatter, **kw)


def _namespace_checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """``args`` once their namespace options passed :class:`NamespaceOptions`' checks
    (a run root too long for the socket paths is a usage error: exit status 2)."""
    parse_config(parser, NamespaceOptions, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    """``launch`` and ``demo`` flags come from their config dataclasses
    (kvswap.daemon.config, kvswap.daemon.demo); the others are declared here."""
    p = argparse.ArgumentParser(prog="kvswap", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--version", action=VersionAction)
    p.set_defaults(make_config=None)  # launch, demo: their config; status, metrics: the args
    sub = p.add_subparsers(dest="cmd", required=True)

    la = _subcommand(sub, "launch", help="start one daemon per rank and supervise them",
                     description="Create the namespace, start one kvswapd per rank, wait until "
                                 "all are READY, stay in the foreground; SIGINT, SIGTERM or SIGHUP stops "
                                 "every daemon and removes the namespace. Every kvswapd option "
                                 "that is the same on every rank is a flag here too and is "
                                 "passed to every rank's daemon. Options may also come from a "
                                 "--config file; flags override it.")
    add_options(la, LaunchConfig, config_file=True)
    la.set_defaults(make_config=lambda args: parse_config(la, LaunchConfig, args))

    st = _subcommand(sub, "status", help="show the state of every rank (reads shared memory only)")
    add_options(st, NamespaceOptions)
    st.set_defaults(make_config=lambda args: _namespace_checked(st, args))
    st.add_argument("--json", action="store_true",
                    help="print one JSON object on one line (with --watch: one per refresh, "
                         "JSON Lines)")
    st.add_argument("--watch", action="store_true",
                    help="refresh until interrupted, with GiB/s per direction since the last "
                         "refresh (on a terminal the table is redrawn in place)")
    st.add_argument("--interval", type=value_type(float, seconds), default=1.0, metavar="SECONDS",
                    help="--watch refresh period in seconds")

    me = _subcommand(sub, "metrics", help="serve a namespace's signals to Prometheus "
                                          "(reads shared memory only)",
                     description="Serve /metrics in Prometheus text format, read from the "
                                 "namespace's signal segment at every scrape; never talks "
                                 "to a daemon. Needs the 'metrics' extra (prometheus-client).")
    add_options(me, NamespaceOptions)
    me.set_defaults(make_config=lambda args: _namespace_checked(me, args))
    me.add_argument("--port", type=value_type(int, between(0, 65535)), required=True,
                    metavar="PORT", help="TCP port (0: any free port)")
    me.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (127.0.0.1: this host only)")

    bench_all.add_parser(bench.add_parser(sub))

    de = _subcommand(sub, "demo", help="run a verified multi-process evict/load workload")
    add_options(de, DemoConfig)
    de.set_defaults(make_config=lambda args: parse_config(de, DemoConfig, args))
    return p


class Writer(Protocol):
    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


class Outlet:
    """``kvswap launch``'s stdout or stderr, which may lose its reader while the namespace
    runs: ``| head``, a pager quit, a closed terminal (EIO after SIGHUP).  The engine
    still needs the namespace, so the launcher goes on without that output: the
    descriptor is pointed at /dev/null and what could not be written is dropped."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> None:
        self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def isatty(self) -> bool:
        return self._stream.isatty()

    def _guard(self, call: Callable[..., object], *args: object) -> None:
        try:
            call(*args)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.EIO):
                raise
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)


class LaunchProgress:
    """What ``kvswap launch`` shows while the ranks start (stdout).

    On a terminal: one line redrawn in place with a bar of the host pools being
    prepared (populated; cuda: and pinned) and how many ranks are in each state.
    Otherwise a plain line each time a rank changes state or activity, with a
    pool's progress in steps of 10 %, so a log file gets a bounded number of lines.
    Rank warnings and errors (``log``) are printed on their own lines, on stderr."""

    BAR = 24  # characters

    def __init__(self, out: Writer, err: Writer, tty: bool):
        self.out, self.err, self.tty = out, err, tty
        self.t0 = time.monotonic()
        self._last: Any = None
        self._drawn = False  # a line without its newline is on the terminal

    def _stamp(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s]"

    def _clear(self) -> None:
        if self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._drawn = False

    def update(self, rows: list[dict]) -> None:
        if self.tty:
            self._draw(rows)
            return
        key = tuple((r["state"], _coarse(r)) for r in rows)
        if key != self._last:
            self._last = key
            text = ", ".join(f"rank {r['rank']} {r['state']}"
                             + (f" ({r['activity']})" if r["activity"] else "") for r in rows)
            print(f"{self._stamp()} waiting: {text}", file=self.out, flush=True)

    def _draw(self, rows: list[dict]) -> None:
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in counts.items())
        total = sum(r["swap_bytes_total"] for r in rows)
        pools = ""
        if total:
            ready = sum(min(r["swap_bytes_pinned"], r["swap_bytes_total"]) for r in rows)
            fill = self.BAR * ready // total
            pools = (f" host pools [{'#' * fill}{'.' * (self.BAR - fill)}] "
                     f"{format_size(ready)} / {format_size(total)}")
        waiting = [r["activity"] for r in rows if r["activity"].startswith("registered")]
        note = f" ({waiting[0]})" if waiting and "READY" not in counts else ""
        self.out.write(f"\r\x1b[K{self._stamp()} {states}{pools}{note}")
        self.out.flush()
        self._drawn = True

    def log(self, rank: int, line: str) -> None:
        self._clear()
        print(f"rank {rank}: {line}", file=self.err, flush=True)

    def done(self) -> None:
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False


def _coarse(row: dict) -> tuple:
    """What a plain progress line changes on: a rank's activity, its pool progress
    rounded down to 10 %."""
    total = row["swap_bytes_total"]
    if not row["cache_ready"] and row["swap_bytes_pinned"] < total:
        return ("preparing", 10 * row["swap_bytes_pinned"] // total)
    return (row["activity"],)


def cmd_launch(cfg: LaunchConfig) -> int:
    from kvswap.daemon.launcher import Launcher

    setup_command_logging()
    stop = threading.Event()
    for s in STOP_SIGNALS:
        signal.signal(s, lambda *_: stop.set())
    status = 0
    launcher = None
    out, err = Outlet(sys.stdout), Outlet(sys.stderr)
    progress = LaunchProgress(out, err, out.isatty())
    try:
        launcher = Launcher(cfg)
        launcher.start()
        try:
            launcher.wait_ready(on_progress=progress.update, stop=stop.is_set, on_log=progress.log)
        finally:
            progress.done()
        print(f"kvswap: namespace {cfg.namespace} READY on {cfg.tp} rank(s) "
              f"(kvswap status --namespace {cfg.namespace})", file=out, flush=True)
        while not stop.wait(0.2):
            end = launcher.supervise_once()
            if end is not None:
                print(f"kvswap: tearing down: {end.why}", file=err, flush=True)
                status = int(end.failed)
                break
    except KvswapError as exc:
        if not stop.is_set():
            print(f"kvswap launch: {exc}", file=err, flush=True)
            status = 1
    finally:
        if launcher is not None:
            launcher.stop()
    return status


def cmd_status(args: argparse.Namespace) -> int:
    """One status, or with ``--watch`` one per ``--interval``.  The table is redrawn in
    place only on a terminal; to a pipe or file each refresh is appended (JSON: one
    object per line).  A reader that goes away (``| head``) ends it quietly, status 0."""
    redraw = args.watch and not args.json and sys.stdout.isatty()
    prev: tuple[float, dict] | None = None  # (monotonic time, snapshot) of the last refresh
    try:
        while True:
            st = read_status(args.namespace, args.run_root)
            now = time.monotonic()
            if args.json:
                text = format_json(st)
            elif args.watch:
                rates = {} if prev is None else transfer_rates(prev[1], st, now - prev[0])
                text = format_table(st, rates)
                if not redraw:
                    text += "\n"  # a blank line between appended frames
            else:
                text = format_table(st)
            prev = (now, st)
            print("\x1b[2J\x1b[H" + text if redraw else text, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
    except KvswapError as exc:
        print(f"kvswap status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader is gone.  Point stdout at /dev/null so the interpreter's final
        # flush of what is still buffered does not fail again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    try:
        from kvswap.daemon import metrics
    except ImportError as exc:
        if exc.name != "prometheus_client":
            raise
        print("kvswap metrics needs prometheus-client: pip install 'kvswap[metrics]'",
              file=sys.stderr)
        return 2
    stop = threading.Event()
    for s in STOP_SIGNALS:
        signal.signal(s, lambda *_: stop.set())
    try:
        server, thread = metrics.serve(args.namespace, args.port, args.host, args.run_root)
    except OSError as exc:
        print(f"kvswap metrics: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
    print(f"kvswap: serving metrics of namespace {args.namespace} on "
          f"http://{host}:{server.server_port}/metrics", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()
    thread.join(5)
    return 0


def cmd_demo(cfg: DemoConfig) -> int:
    from kvswap.daemon.demo import run_demo

    setup_command_logging()
    logging.getLogger("kvswap").setLevel(logging.WARNING)
    try:
        res = run_demo(cfg)
    except KvswapError as exc:
        print(f"kvswap demo: {exc}", file=sys.stderr)
        return 1
    print(res.summary(), flush=True)
    for m in res.mismatches[:20]:
        print(f"  MISMATCH {m}", file=sys.stderr)
    for leak in res.leaks:
        print(f"  LEAK {leak}", file=sys.stderr)
    return 0 if res.ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    setup_command_logging()
    logging.getLogger("kvswap").setLevel(logging.WARNING)
    try:
        return bench.run(args)
    except KvswapError as exc:
        print(f"kvswap bench: {exc}", file=sys.stderr)
        return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target = args if args.make_config is None else args.make_config(args)
    if args.cmd in ("demo", "bench"):
        # They launch throw-away namespaces (and servers, temporary directories) and
        # remove them in finally blocks: SIGTERM must run those, as Ctrl-C does,
        # rather than end the process where it stands and leave everything behind.
        for s in STOP_SIGNALS[1:]:
            signal.signal(s, _interrupt)
    try:
        return {"launch": cmd_launch, "status": cmd_status, "demo": cmd_demo,
                "bench": cmd_bench, "metrics": cmd_metrics}[args.cmd](target)
    except ValueError as exc:
        print(f"kvswap {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if args.cmd not in ("demo", "bench"):
            raise
        print(f"kvswap {args.cmd}: interrupted ({exc or 'SIGINT'}); cleaned up",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
