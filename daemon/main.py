"""``kvswapd``: run one rank daemon in the foreground (normally started by ``kvswap launch``)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from kvswap.client import __version__
from kvswap.client.errors import KvswapError
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon.logs import setup_logging
from kvswap.daemon.options import HelpFormatter, add_options, parse_config
from kvswap.daemon.server import Daemon, DaemonError


def build_parser() -> argparse.ArgumentParser:
    """Every flag comes from a :class:`DaemonConfig` field (kvswap.daemon.config)."""
    p = argparse.ArgumentParser(prog="kvswapd", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_options(p, DaemonConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg: DaemonConfig = parse_config(parser, DaemonConfig, parser.parse_args(argv))
    setup_logging(cfg.rank, cfg.log_level)
    # `kill -USR1 <pid>` writes every thread's stack to the rank's log: the first
    # thing to look at when a daemon seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log = logging.getLogger("kvswap.daemon")
    try:
        return Daemon(cfg).run()
    except (DaemonError, KvswapError) as exc:
        log.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
