"""``kvswap``: launch a namespace, show its status, run the demo."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
import time

from kvswap.client.errors import KvswapError
from kvswap.client.layout import DEMO_LAYOUT_HELP, parse_demo_layout
from kvswap.client.monitor import format_json, format_table, read_status, transfer_rates
from kvswap.daemon import bench


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", required=True, help="namespace (one engine instance)")
    p.add_argument("--run-root", default=None,
                   help="parent of the run dir (default $KVSWAP_RUN_ROOT, "
                        "$XDG_RUNTIME_DIR/kvswap or /tmp/kvswap-<uid>)")


def _devices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices takes a list like 0,1 (got {text!r})")


def _layout(text: str) -> str:
    try:
        parse_demo_layout(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc))
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvswap", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    la = sub.add_parser("launch", help="start one daemon per rank and supervise them",
                        description="Create the namespace, start one kvswapd per rank, wait "
                                    "until all are READY, stay in the foreground; SIGINT or "
                                    "SIGTERM stops every daemon and removes the namespace.")
    _add_common(la)
    la.add_argument("--tp", type=int, required=True, help="number of ranks")
    la.add_argument("--backend", choices=("host", "cuda"), default="host",
                    help="host: simulated device in shm (no GPU); cuda: real GPUs")
    la.add_argument("--host-blocks", type=int, default=1024,
                    help="blocks of host swap space per tensor and rank (default 1024)")
    la.add_argument("--devices", type=_devices, default=None,
                    help="GPU ordinal per rank, e.g. 0,1 (cuda backend)")
    la.add_argument("--demo-caches", nargs="?", const="", default=None, type=_layout,
                    metavar="LAYOUT",
                    help="daemons create their own simulated caches instead of waiting for "
                         "CacheWorkers to register. LAYOUT: " + DEMO_LAYOUT_HELP)
    la.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for every rank to be READY (default 600)")
    la.add_argument("--stop-timeout", type=float, default=10.0,
                    help="deadline for the staged stop: shutdown message, SIGTERM at 50%%, "
                         "SIGKILL at 80%% (default 10)")
    la.add_argument("--log-dir", default=None,
                    help="where per-rank logs go (default: the run dir, removed at teardown)")
    la.add_argument("--log-level", default="INFO")
    la.add_argument("--max-restarts", type=int, default=5,
                    help="consecutive failed restarts of a rank before it is FATAL and the "
                         "namespace is torn down (default 5; 0 = never restart)")
    la.add_argument("--stale-after", type=float, default=10.0,
                    help="a daemon whose heartbeat is older than this is killed and restarted "
                         "(default 10)")
    la.add_argument("--engine-timeout", type=float, default=60.0,
                    help="once the engine has beaten, tear everything down if it stays silent "
                         "this long (default 60; 0 = never)")
    la.add_argument("--tcp", default=None, metavar="HOST:BASEPORT",
                    help="rank r also listens on tcp://HOST:BASEPORT+r, accepting only "
                         "HMAC-SHA256 signed messages (needs --secret-file)")
    la.add_argument("--secret-file", default=None, help="shared secret for --tcp (mode 0600)")
    la.add_argument("--storage", default=None, metavar="URL",
                    help="storage tier: file:///DIR[?capacity_bytes=N] or redis://HOST:PORT/DB")
    la.add_argument("--model-id", default="default",
                    help="model identity in stored entries' names (with the cache layout)")
    la.add_argument("--daemon-args", default="", metavar="ARGS",
                    help="extra kvswapd flags, one quoted string, e.g. "
                         "\"--workers 4 --orphan-timeout 10\" (see kvswapd --help)")

    st = sub.add_parser("status", help="show the state of every rank (reads shared memory only)")
    _add_common(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--watch", action="store_true",
                    help="refresh until interrupted, with GB/s per direction since the last "
                         "refresh")
    st.add_argument("--interval", type=float, default=1.0, help="--watch refresh period")

    me = sub.add_parser("metrics", help="serve a namespace's signals to Prometheus "
                                        "(reads shared memory only)",
                        description="Serve /metrics in Prometheus text format, read from the "
                                    "namespace's signal segment at every scrape; never talks "
                                    "to a daemon. Needs the 'metrics' extra (prometheus-client).")
    _add_common(me)
    me.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    me.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this host only)")

    bench.add_parser(sub)

    de = sub.add_parser("demo", help="run a verified multi-process evict/load workload")
    de.add_argument("--tp", type=int, default=2)
    de.add_argument("--tasks", type=int, default=600)
    de.add_argument("--threads", type=int, default=4)
    de.add_argument("--host-blocks", type=int, default=256)
    de.add_argument("--layout", type=_layout, default="", help=DEMO_LAYOUT_HELP)
    de.add_argument("--seed", type=int, default=0)
    de.add_argument("--run-root", default=None)
    return p


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_launch(args: argparse.Namespace) -> int:
    from kvswap.daemon.launcher import LaunchConfig, Launcher
    from kvswap.daemon.supervisor import SupervisorConfig

    _setup_logging()
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    status = 0
    launcher = None
    try:
        launcher = Launcher(LaunchConfig(
            namespace=args.namespace, tp=args.tp, backend=args.backend,
            host_blocks=args.host_blocks, devices=args.devices, run_root=args.run_root,
            demo_caches=args.demo_caches, log_dir=args.log_dir,
            ready_timeout_s=args.ready_timeout, stop_timeout_s=args.stop_timeout,
            log_level=args.log_level, daemon_args=shlex.split(args.daemon_args),
            engine_timeout_s=args.engine_timeout, tcp=args.tcp, secret_file=args.secret_file,
            storage_url=args.storage, model_id=args.model_id,
            supervision=SupervisorConfig(max_retries=args.max_restarts,
                                         stale_after_s=args.stale_after)))
        launcher.start()
        t0 = time.monotonic()
        launcher.wait_ready(on_progress=lambda text: print(
            f"[{time.monotonic() - t0:6.1f}s] waiting: {text}", flush=True), stop=stop.is_set)
        print(f"kvswap: namespace {args.namespace} READY on {args.tp} rank(s) "
              f"(kvswap status --namespace {args.namespace})", flush=True)
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


def cmd_demo(args: argparse.Namespace) -> int:
    from kvswap.daemon.demo import DemoConfig, run_demo

    _setup_logging()
    logging.getLogger("kvswap").setLevel(logging.WARNING)
    try:
        res = run_demo(DemoConfig(tp=args.tp, tasks=args.tasks, threads=args.threads,
                                  host_blocks=args.host_blocks, layout=args.layout,
                                  seed=args.seed, run_root=args.run_root))
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
    try:
        return {"launch": cmd_launch, "status": cmd_status, "demo": cmd_demo,
                "bench": cmd_bench, "metrics": cmd_metrics}[args.cmd](args)
    except ValueError as exc:
        print(f"kvswap {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
