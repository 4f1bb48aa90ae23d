"""``kvswapd``: run one rank daemon in the foreground (normally started by ``kvswap launch``)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
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
    p.add_argument("--max-message-bytes", type=int, default=64 << 20)
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.rank, args.log_level)
    # `kill -USR1 <pid>` writes every thread's stack to the rank's log: the first
    # thing to look at when a daemon seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log = logging.getLogger("kvswap.daemon")
    if args.host_blocks <= 0:
        log.error("--host-blocks must be positive")
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
        stale_after_s=args.stale_after, max_message_bytes=args.max_message_bytes,
        device=args.device,
    )
    try:
        return Daemon(cfg).run()
    except (DaemonError, KvswapError) as exc:
        log.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
