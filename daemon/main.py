"""``kvswapd``: run one rank daemon in the foreground (normally started by ``kvswap launch``)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import resource
import signal
import sys

from kvswap.client.errors import KvswapError
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon import malloc_tuning
from kvswap.daemon.logs import setup_logging
from kvswap.daemon.options import HelpFormatter, VersionAction, add_options, parse_config
from kvswap.daemon.jobs import DaemonError
from kvswap.daemon.server import Daemon
from kvswap.daemon.storage.mooncake_buffers import kept_until_exit


def build_parser() -> argparse.ArgumentParser:
    """Every flag comes from a :class:`DaemonConfig` field (kvswap.daemon.config)."""
    p = argparse.ArgumentParser(prog="kvswapd", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action=VersionAction)
    add_options(p, DaemonConfig)
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
    parser = build_parser()
    cfg: DaemonConfig = parse_config(parser, DaemonConfig, parser.parse_args(argv))
    setup_logging(cfg.rank, cfg.log_level)
    # `kill -USR1 <pid>` writes every thread's stack to the rank's log: the first
    # thing to look at when a daemon seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    log = logging.getLogger("kvswap.daemon")
    raise_fd_limit(log)
    log.info("%s", malloc_tuning.tune())
    try:
        status = Daemon(cfg).run()
    except (DaemonError, KvswapError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    except BaseException:
        if not kept_until_exit():
            raise
        log.exception("the daemon ended on an error")  # its teardown ran: see above
        status = 1
    if kept_until_exit():
        # A store client was left open (its master did not answer: docs/storage.md
        # section 7, "Closing").  Its library's exit handler would unmount it through
        # that master, holding the exit 11 s and more past the clean stop (killed at
        # --stop-timeout), or abort the process if a call returned meanwhile.  The stop
        # is done and the master expires the client by itself.
        log.warning("exiting without the store client's teardown (its master did not "
                    "answer)")
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
