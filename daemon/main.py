"""``kvswapd``: run one rank daemon in the foreground (normally started by ``kvswap launch``)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import resource
import signal
import sys

from kvswap.client.errors import KvswapError
from kvswap.client.layout import DEMO_LAYOUT_HELP, parse_demo_layout
from kvswap.daemon.logs import setup_logging
from kvswap.daemon.server import Daemon, DaemonConfig, DaemonError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvswapd", description=__doc__)
    p.add_argument("--namespace", required=True, help="namespace created by 'kvswap launch'")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True, help="number of ranks (tensor parallel size)")
    p.add_argument("--backend", choices=("host", "cuda"), default="host")
    p.add_argument("--run-root", default=None, help="parent of the namespace's run dir")
    p.add_argument("--host-blocks", type=int, default=1024,
                   help="blocks of host swap space per tensor (default 1024)")
    p.add_argument("--demo-caches", nargs="?", const="", default=None, metavar="LAYOUT",
                   help="create simulated caches instead of waiting for a CacheWorker: "
                        + DEMO_LAYOUT_HELP)
    p.add_argument("--device", type=int, default=None, help="GPU ordinal (cuda backend)")
    p.add_argument("--attach-timeout", type=float, default=300.0,
                   help="seconds to wait for every rank to attach its caches (default 300)")
    p.add_argument("--heartbeat-interval", type=float, default=0.1)
    p.add_argument("--stale-after", type=float, default=5.0,
                   help="a peer whose heartbeat is older than this aborts barriers (default 5)")
    p.add_argument("--max-device-blocks", type=int, default=1 << 20,
                   help="most device blocks a worker may register (default 1048576); with "
                        "--host-blocks it sizes the largest frame the socket accepts "
                        "(8 bytes per block id), so a peer cannot make the daemon buffer "
                        "larger ones (docs/protocol.md section 2)")
    p.add_argument("--workers", type=int, default=2,
                   help="transfer worker threads (evicts and loads run concurrently; default 2)")
    p.add_argument("--no-merge", action="store_true",
                   help="never merge independent queued tasks into one copy pass")
    p.add_argument("--max-merge-blocks", type=int, default=4096,
                   help="most blocks one merged copy pass may carry (default 4096)")
    p.add_argument("--listen-tcp", default=None, metavar="tcp://HOST:PORT",
                   help="also accept requests on this tcp:// address; every message on it must "
                        "be HMAC-SHA256 signed with --secret-file (ipc:// only by default)")
    p.add_argument("--secret-file", default=None,
                   help="shared secret for --listen-tcp (mode 0600, >= 16 bytes)")
    p.add_argument("--replay-window", type=float, default=60.0,
                   help="signed requests must be this fresh; replays inside it are refused")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="storage tier behind the host swap space: file:///DIR[?capacity_bytes=N] "
                        "or redis://HOST:PORT/DB (docs/storage.md)")
    p.add_argument("--model-id", default="default",
                   help="model identity mixed into every stored entry's name, so two models "
                        "never share entries (default 'default')")
    p.add_argument("--storage-timeout", type=float, default=30.0,
                   help="how long a prefetch waits for the other ranks to agree (default 30)")
    p.add_argument("--orphan-timeout", type=float, default=30.0,
                   help="exit when the launcher is gone and the engine heartbeat has been "
                        "silent (or absent) this long (default 30)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="clear: how long to wait for accepted tasks to finish (default 60)")
    p.add_argument("--inline-max-bytes", type=int, default=256 << 10,
                   help="a task of at most this many bytes that is ready while nothing else "
                        "is queued runs on the I/O thread, skipping two thread hand-offs "
                        "(0 disables; default 262144)")
    p.add_argument("--log-level", default="INFO")
    return p


def raise_fd_limit(log: logging.Logger) -> None:
    """Raise the soft open-file limit to the hard one, as servers do.

    Every connection to the daemon holds a file descriptor, and the common soft
    limit of 1024 is a default for interactive shells, not a server's budget;
    the hard limit is what the administrator granted.  The connection guard
    (daemon/connections.py) keeps the daemon inside whatever limit results."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # setrlimit refuses more than fs.nr_open
        with open("/proc/sys/fs/nr_open") as f:
            target = int(f.read())
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        else:
            log.info("open-file limit raised from %d to the hard limit %d", soft, target)
            return
    log.info("open-file limit %d (hard limit %s)", soft,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.rank, args.log_level)
    # `kill -USR1 <pid>` writes every thread's stack to the rank's log: the first
    # thing to look at when a daemon seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log = logging.getLogger("kvswap.daemon")
    raise_fd_limit(log)
    for name in ("host_blocks", "workers", "max_merge_blocks", "max_device_blocks"):
        if getattr(args, name) <= 0:
            log.error("--%s must be positive", name.replace("_", "-"))
            return 2
    if args.listen_tcp and not args.listen_tcp.startswith("tcp://"):
        log.error("--listen-tcp must be a tcp://HOST:PORT address")
        return 2
    if args.demo_caches is not None:
        try:
            parse_demo_layout(args.demo_caches)
        except (ValueError, TypeError) as exc:
            log.error("bad --demo-caches: %s", exc)
            return 2
    cfg = DaemonConfig(
        namespace=args.namespace, rank=args.rank, tp_size=args.tp, backend=args.backend,
        run_root=args.run_root, host_blocks=args.host_blocks, demo_caches=args.demo_caches,
        attach_timeout_s=args.attach_timeout, heartbeat_interval_s=args.heartbeat_interval,
        stale_after_s=args.stale_after, max_device_blocks=args.max_device_blocks,
        device=args.device, workers=args.workers, merge=not args.no_merge,
        max_merge_blocks=args.max_merge_blocks, inline_max_bytes=args.inline_max_bytes,
        orphan_timeout_s=args.orphan_timeout, drain_timeout_s=args.drain_timeout,
        listen_tcp=args.listen_tcp, secret_file=args.secret_file,
        replay_window_s=args.replay_window, storage_url=args.storage, model_id=args.model_id,
        storage_timeout_s=args.storage_timeout,
    )
    try:
        return Daemon(cfg).run()
    except (DaemonError, KvswapError) as exc:
        log.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
