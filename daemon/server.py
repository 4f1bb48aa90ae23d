"""The per-rank transfer daemon (``kvswapd``): the parts, composed.

Each part owns its state (docs/architecture.md, sections 2 and 11):

* :mod:`~kvswap.daemon.rank`: identity, signal slot, state machine, heartbeat;
* :mod:`~kvswap.daemon.io_loop`: the I/O thread (sockets, routing, replies);
* :mod:`~kvswap.daemon.attachment`: register/attach, the published attachment;
* :mod:`~kvswap.daemon.startup`: the entry into the namespace (first start, restart);
* :mod:`~kvswap.daemon.exactly_once`: the completion journal;
* :mod:`~kvswap.daemon.transfers`: evict, load, batch, cancel;
* :mod:`~kvswap.daemon.storage_service`: backup, prefetch, exists;
* :mod:`~kvswap.daemon.peer_ops`: peer_info, peer_recv, peer_send (node to node);
* :mod:`~kvswap.daemon.lifecycle`: the control thread and every state change.

This module wires them, owns the op -> handler table, runs the I/O loop on the
main thread and releases everything in order when it ends.
"""

from __future__ import annotations

import logging
import os
import queue
import signal

import zmq

from kvswap.client.auth import load_secret
from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.protocol import Op
from kvswap.client.signals import RankState
from kvswap.daemon import crashpoints
from kvswap.daemon.attachment import AttachmentSlot, Registrar
from kvswap.daemon.backend import make_backend
from kvswap.daemon.config import DaemonConfig
from kvswap.daemon.exactly_once import ExactlyOnce
from kvswap.daemon.io_loop import STOP_SIGNALS, IoLoop
from kvswap.daemon.jobs import DaemonError, Handler, Job, check_handlers
from kvswap.daemon.journal import Journal
from kvswap.daemon.lifecycle import Lifecycle
from kvswap.daemon.peer_ops import PeerOps
from kvswap.daemon.rank import Heartbeat, RankContext
from kvswap.daemon.startup import Startup
from kvswap.daemon.storage_service import StorageService
from kvswap.daemon.transfers import Transfers


log = logging.getLogger("kvswap.daemon")


class Daemon:
    """One rank's daemon: ``Daemon(cfg).run()`` serves until stopped."""

    def __init__(self, cfg: DaemonConfig):
        if cfg.listen_tcp and not cfg.secret_file:
            raise DaemonError("a tcp:// listener needs --secret-file (HMAC-SHA256 shared secret)")
        self.cfg = cfg
        self._secret = load_secret(cfg.secret_file) if cfg.listen_tcp else b""

    def run(self) -> int:
        """Open the rank, bind, attach, serve; the exit status (0 after a clean stop,
        1 if the I/O loop crashed, 2 if the socket cannot be bound; the heartbeat
        thread ends a stop still running after --drain-timeout with status 3)."""
        cfg = self.cfg
        # A stop signal before the I/O loop takes them (the launcher's SIGTERM, or the
        # heartbeat's own when it finds the daemon orphaned at its first beat) would
        # end the process where it stands, leaving its journal and state behind: it
        # is held here and raised again once the I/O loop's clean stop can run.
        held: list[int] = []
        for s in STOP_SIGNALS:
            signal.signal(s, lambda signum, _frame: held.append(signum))
        rank = RankContext.open(cfg)
        crashpoints.configure(rank.names.run_dir)
        journal = Journal.open(rank.names, rank.index, cfg.journal_records, cfg.journal_mib << 20)
        if journal.reused:
            log.info("completion journal adopted (%d task(s) in doubt)", journal.admitted)
        backend = make_backend(cfg.backend, rank.names, rank.index, device=cfg.device,
                               on_pin_progress=rank.on_pin_progress)
        rank.sm.to(RankState.STARTING)
        heartbeat = Heartbeat(rank)
        heartbeat.start()
        try:
            io = IoLoop(rank, self._secret)  # takes over the stop signals
        except zmq.ZMQError as exc:
            rank.sm.fail(ErrorCode.NAMESPACE_ERROR,
                         f"cannot bind {rank.names.endpoint(rank.index)}: {exc}")
            journal.close(unlink=False)  # a failed start: keep it for the next incarnation
            heartbeat.stop()
            rank.close()
            return 2
        if held:
            os.kill(os.getpid(), held[0])  # now the I/O loop's: the clean stop
        control: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        slot = AttachmentSlot()
        exactly = ExactlyOnce(rank, journal, io)
        storage = StorageService(rank, slot, exactly)
        try:
            peer = PeerOps(rank, slot, exactly)
        except KvswapError as exc:  # --peer-transfer: the Transfer Engine did not start
            rank.sm.fail(exc.code, exc.message)
            io.close()
            journal.close(unlink=False)
            heartbeat.stop()
            rank.close()
            return 2
        transfers = Transfers(rank, backend, io, slot, exactly, storage, peer)
        registrar = Registrar(rank, backend, io, slot, storage, control, transfers.run_batch,
                              pool_users=[storage, peer])
        startup = Startup(rank, registrar)
        life = Lifecycle(rank, io, slot, registrar, startup, exactly, transfers, peer, control)
        handlers = {
            Op.REGISTER: Handler(run=registrar.run, admit=registrar.admit),
            Op.EVICT: Handler(admit=transfers.admit, claims=True),
            Op.LOAD: Handler(admit=transfers.admit, claims=True),
            Op.BACKUP: Handler(admit=storage.admit),
            Op.PREFETCH: Handler(admit=storage.admit),
            Op.EXISTS: Handler(admit=storage.admit),
            Op.BATCH: Handler(run=transfers.run_batch_request, claims=True),
            Op.CANCEL: Handler(run=transfers.cancel),
            Op.PAUSE: Handler(run=life.pause),
            Op.RESUME: Handler(run=life.resume),
            Op.CLEAR: Handler(run=life.run_clear, admit=life.admit_clear),
            Op.RESTORE: Handler(run=life.restore),
            Op.PING: Handler(run=life.ping),
            Op.STATS: Handler(run=life.stats),
            Op.SHUTDOWN: Handler(run=life.shutdown),
            Op.PEER_INFO: Handler(run=peer.info),
            Op.PEER_RECV: Handler(admit=peer.admit),
            Op.PEER_SEND: Handler(admit=peer.admit),
        }
        check_handlers(handlers)
        life.start(handlers)
        rank.sm.to(RankState.ATTACHING)
        log.info("serving %s (backend %s, tp %d, host pool %s, epoch %d, pid %d)",
                 rank.names.endpoint(rank.index), cfg.backend, cfg.tp_size, cfg.pool_text(),
                 rank.epoch, os.getpid())
        startup.begin()
        status = 0
        try:
            io.serve(handlers, life.begin_stop, life.workers_done, transfers.copy_claimed)
        except BaseException:
            log.exception("I/O loop crashed; stopping")
            status = 1
            raise
        finally:
            life.begin_stop("teardown")
            # Release in the reverse order of use, each part once its threads ended.
            life.join(60)
            att = slot.current
            if att is not None and not att.scheduler.join(60):
                log.error("transfer workers did not finish within 60s")
            peer.close()
            registrar.release()
            startup.release()
            storage.close()
            exactly.close()
            io.close()
            if rank.sm.state is RankState.STOPPING:
                rank.sm.to(RankState.STOPPED)
            heartbeat.stop()
            rank.close()
            log.info("stopped")
        return status
