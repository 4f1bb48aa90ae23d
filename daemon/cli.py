"""``kvswap``: launch a namespace, show its status, run the demo."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

from kvswap.client import __version__
from kvswap.client.errors import KvswapError
from kvswap.client.monitor import format_json, format_table, read_status, transfer_rates
from kvswap.daemon import bench, bench_all
from kvswap.daemon.config import LaunchConfig, NamespaceOptions
from kvswap.daemon.demo import DemoConfig
from kvswap.daemon.options import (
    HelpFormatter,
    add_options,
    between,
    parse_config,
    positive,
    value_type,
)


def _subcommand(sub: argparse._SubParsersAction, name: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, formatter_class=HelpFormatter, **kw)


def build_parser() -> argparse.ArgumentParser:
    """``launch`` and ``demo`` flags come from their config dataclasses
    (kvswap.daemon.config, kvswap.daemon.demo); the others are declared here."""
    p = argparse.ArgumentParser(prog="kvswap", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.set_defaults(make_config=None)  # launch, demo: their config, built from the args
    sub = p.add_subparsers(dest="cmd", required=True)

    la = _subcommand(sub, "launch", help="start one daemon per rank and supervise them",
                     description="Create the namespace, start one kvswapd per rank, wait until "
                                 "all are READY, stay in the foreground; SIGINT or SIGTERM stops "
                                 "every daemon and removes the namespace. Every kvswapd option "
                                 "that is the same on every rank is a flag here too and is "
                                 "passed to every rank's daemon.")
    add_options(la, LaunchConfig)
    la.set_defaults(make_config=lambda args: parse_config(la, LaunchConfig, args))

    st = _subcommand(sub, "status", help="show the state of every rank (reads shared memory only)")
    add_options(st, NamespaceOptions)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--watch", action="store_true",
                    help="refresh until interrupted, with GB/s per direction since the last "
                         "refresh")
    st.add_argument("--interval", type=value_type(float, positive), default=1.0, metavar="SECONDS",
                    help="--watch refresh period in seconds")

    me = _subcommand(sub, "metrics", help="serve a namespace's signals to Prometheus "
                                          "(reads shared memory only)",
                     description="Serve /metrics in Prometheus text format, read from the "
                                 "namespace's signal segment at every scrape; never talks "
                                 "to a daemon. Needs the 'metrics' extra (prometheus-client).")
    add_options(me, NamespaceOptions)
    me.add_argument("--port", type=value_type(int, between(0, 65535)), required=True,
                    metavar="PORT", help="TCP port (0: any free port)")
    me.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (127.0.0.1: this host only)")

    bench_all.add_parser(bench.add_parser(sub))

    de = _subcommand(sub, "demo", help="run a verified multi-process evict/load workload")
    add_options(de, DemoConfig)
    de.set_defaults(make_config=lambda args: parse_config(de, DemoConfig, args))
    return p


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_launch(cfg: LaunchConfig) -> int:
    from kvswap.daemon.launcher import Launcher

    _setup_logging()
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    status = 0
    launcher = None
    try:
        launcher = Launcher(cfg)
        launcher.start()
        t0 = time.monotonic()
        launcher.wait_ready(on_progress=lambda text: print(
            f"[{time.monotonic() - t0:6.1f}s] waiting: {text}", flush=True), stop=stop.is_set)
        print(f"kvswap: namespace {cfg.namespace} READY on {cfg.tp} rank(s) "
              f"(kvswap status --namespace {cfg.namespace})", flush=True)
        while not stop.wait(0.2):
            why = launcher.supervise_once()
            if why:
                print(f"kvswap: tearing down: {why}", file=sys.stderr, flush=True)
                status = 1
                break
    except KvswapError as exc:
        if not stop.is_set():
            print(f"kvswap launch: {exc}", file=sys.stderr)
            status = 1
    finally:
        if launcher is not None:
            launcher.stop()
    return status


def cmd_status(args: argparse.Namespace) -> int:
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
            else:
                text = format_table(st)
            prev = (now, st)
            if args.watch:
                print("\x1b[2J\x1b[H" + text, flush=True)
                time.sleep(args.interval)
            else:
                print(text)
                return 0
    except KvswapError as exc:
        print(f"kvswap status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
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
    for s in (signal.SIGINT, signal.SIGTERM):
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

    _setup_logging()
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
    _setup_logging()
    logging.getLogger("kvswap").setLevel(logging.WARNING)
    try:
        return bench.run(args)
    except KvswapError as exc:
        print(f"kvswap bench: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target = args if args.make_config is None else args.make_config(args)
    try:
        return {"launch": cmd_launch, "status": cmd_status, "demo": cmd_demo,
                "bench": cmd_bench, "metrics": cmd_metrics}[args.cmd](target)
    except ValueError as exc:
        print(f"kvswap {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
