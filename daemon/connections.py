"""Refuse connections before they use up the daemon's file descriptors.

Every connection a peer opens to a rank's ROUTER holds one file descriptor in
the daemon until the peer goes away.  Running out is fatal, not just a refused
connection: libzmq 4.3's ``ipc://`` listener asserts that ``accept()`` never
fails with EMFILE (``src/ipc_listener.cpp``) and aborts the process, so
enough idle DEALERs would kill the daemon, its restarts too, and the
supervisor would give up on the namespace.

:class:`ConnectionGuard` lets connections use a quarter of ``RLIMIT_NOFILE``
and keeps the rest for the daemon's own needs (shm segments, storage files and
sockets, CUDA driver handles) and as head room for the connections libzmq
accepts before the guard sees them.  A new ``tcp://`` connection is let in only
while fewer than an eighth are open: anyone who reaches the port can open them
without the secret, and holding them all must not lock the namespace's own local
peers (workers, clients, the launcher) out of ``ipc://``.  And no connection may
take a descriptor in the last eighth of the limit, whatever the counts::

    open connections  0 ........ limit/8 ........ limit/4 ...... refused
                      | tcp, ipc | ipc only       |
    descriptor number 0 ........................... 7/8 limit ... refused

Connections are *counted*, from the monitor's ACCEPTED and DISCONNECTED events
(every accepted connection that ends reports DISCONNECTED with its descriptor:
closed by the peer, its process killed, a failed handshake, or refused here).
Descriptor numbers alone say how many descriptors are open, not how many are
connections: the ``host`` backend holds one per registered tensor (a mapping
keeps one), so 320 tensors refused every client under a limit of 1024, and the
hundreds a clear frees let a flood of idle connections take half the limit.
A count kept from events could only drift on an event libzmq failed to send, so
before it refuses, the guard drops from the count any descriptor that is no
longer a socket (at most once a second).

A rank serves a handful of peers (the engine's clients and workers, the
launcher, monitors), so a quarter is far more than they need: 256 connections
under a hard limit of 1024, 16384 under 65536.

It runs a thread on the ROUTERs' monitor sockets.  For every ``ACCEPTED``
event (its value is the new connection's descriptor) past the share it shuts
that connection down.
``shutdown(SHUT_RDWR)`` on the descriptor makes libzmq see the connection end
and drop it cleanly; the descriptor stays libzmq's to close.  Before touching
it the guard checks that it still is a connection of that listener: an event
can arrive after its connection closed and its number was reused.

A refused DEALER reconnects 100 ms later, so refusing alone turns a flood of N
idle connections into N accepts and refusals every 100 ms, and when that
outruns the guard the descriptors in flight exhaust the limit after all
(measured: 1500 DEALERs against a limit of 256).  So on ``ipc://`` the guard
also closes the door: it renames the socket file away for :data:`DOOR_S`, and
new connects fail in the peer (ENOENT) without reaching the daemon, while
established connections, which do not use the name, go on.  It renames it
back after that, or at :meth:`ConnectionGuard.close` so libzmq removes it as
usual.  A ``tcp://`` port has no such door; there libzmq survives EMFILE
(reporting ``accept failed``) and the guard refuses connection by connection.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvswap.client.signals import RankSignals, RankSlot

log = logging.getLogger("kvswap.daemon")

_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
           | zmq.EVENT_MONITOR_STOPPED)
DOOR_S = 1.0  # how long an ipc:// socket file stays renamed away after a refusal
LOG_EVERY_S = 30.0  # refusal reports; longer than the log filter's 10 s window (daemon/logs.py)


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (what ``open``/``accept`` fail at)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # closed
        return False


def _is_connection_of(sock: socket.socket, endpoint: str) -> bool:
    """Whether ``sock`` was accepted by the listener bound to ``endpoint``: an
    accepted socket's local address is the listener's path (ipc) or port (tcp)."""
    try:
        local = sock.getsockname()
    except OSError:
        return False
    if endpoint.startswith("ipc://"):
        return sock.family == socket.AF_UNIX and local == endpoint[len("ipc://"):]
    port = endpoint.rsplit(":", 1)[-1]
    return (sock.family in (socket.AF_INET, socket.AF_INET6) and port.isdigit()
            and local[1] == int(port))


class ConnectionGuard:
    """Watches the given bound ROUTERs and refuses connections past the threshold.

    Created and closed by the thread that owns the ROUTERs (``monitor`` and
    ``disable_monitor`` are calls on them); the monitor sockets and the door
    belong to the guard's thread until :meth:`close` has joined it.  Refusals
    are logged at most once per :data:`LOG_EVERY_S`, with a count, and counted in the
    rank's ``conn_refused`` slot (written by the guard's thread only), so a client whose
    tasks time out can name the likely cause."""

    def __init__(self, ctx: zmq.Context, routers: list[zmq.Socket], sig: RankSignals):
        self.limit = fd_limit()
        self._sig = sig
        self.threshold = self.limit // 4
        self.tcp_threshold = self.limit // 8
        self.refused = 0  # connections shut down (guard thread only; published as conn_refused)
        self._reported = 0  # refusals already counted in a log line
        self._reported_at = -LOG_EVERY_S  # monotonic time of the last report
        self._closed_doors: dict[str, float] = {}  # ipc path -> monotonic time to reopen
        self._open: set[tuple[bool, int]] = set()  # (tcp, descriptor) of each connection
        self._checked_until = 0.0  # monotonic time before which _open is not re-checked
        self._failed_accepts = 0  # accepts libzmq reported failed since the last report
        self._failed_reported_at = -LOG_EVERY_S
        self._routers: list[zmq.Socket] = []  # those with a monitor enabled
        self._monitors: list[zmq.Socket] = []
        try:
            for i, router in enumerate(routers):
                addr = f"inproc://kvswap-monitor-{id(self)}-{i}"
                router.monitor(addr, _EVENTS)
                self._routers.append(router)
                mon = ctx.socket(zmq.PAIR)
                self._monitors.append(mon)
                # Never drop an ACCEPTED event: a missed one is a connection kept past
                # the threshold.  The queue holds about one event per connection
                # accepted while the guard is behind, so the fd limit bounds it.
                mon.setsockopt(zmq.RCVHWM, 0)
                mon.setsockopt(zmq.LINGER, 0)
                mon.connect(addr)
        except zmq.ZMQError:
            self._stop_monitors()
            for mon in self._monitors:
                mon.close()
            raise
        self._thread = threading.Thread(target=self._run, name="connection-guard", daemon=True)
        self._thread.start()

    def _stop_monitors(self) -> None:
        for router in self._routers:
            router.disable_monitor()

    def close(self) -> None:
        """Stop monitoring (the thread exits once every monitor reported it stopped)
        and put back any socket file renamed away."""
        self._stop_monitors()
        self._thread.join(10)
        if self._thread.is_alive():
            log.error("connection guard did not stop within 10s")
            return
        for path in list(self._closed_doors):
            self._open_door(path)

    # ------------------------------------------------------------ guard thread
    def _run(self) -> None:
        poller = zmq.Poller()
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        live = len(self._monitors)
        while live:
            now = time.monotonic()
            for path, reopen_at in list(self._closed_doors.items()):
                if now >= reopen_at:
                    self._open_door(path)
            wait = min(self._closed_doors.values(), default=None)
            timeout = None if wait is None else max(0, int((wait - now) * 1000) + 1)
            for mon, _ in poller.poll(timeout):
                while True:  # drain: one wake-up per burst, not per event
                    try:
                        frames = mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    event = parse_monitor_message(frames)
                    kind = event["event"]
                    if kind == zmq.EVENT_ACCEPTED:
                        endpoint = event["endpoint"].decode()
                        tcp = endpoint.startswith("tcp://")
                        self._open.add((tcp, event["value"]))
                        if self._over_share(event["value"], tcp):
                            self._refuse(event["value"], endpoint)
                    elif kind == zmq.EVENT_DISCONNECTED:
                        tcp = event["endpoint"].decode().startswith("tcp://")
                        self._open.discard((tcp, event["value"]))
                    elif kind == zmq.EVENT_ACCEPT_FAILED:
                        self._accept_failed(event["endpoint"].decode(), event["value"])
                    elif kind == zmq.EVENT_MONITOR_STOPPED:
                        poller.unregister(mon)
                        mon.close()
                        live -= 1
                        break

    def _accept_failed(self, endpoint: str, err: int) -> None:
        """Logged at most once per :data:`LOG_EVERY_S`, with a count: in a flood that
        ran the process out of descriptors libzmq reports every failed accept, and a
        line each (177,000 in 10 s) kept the guard from the events it must act on."""
        self._failed_accepts += 1
        now = time.monotonic()
        if now - self._failed_reported_at >= LOG_EVERY_S:
            log.error("accept failed on %s: %s (%d time(s) since the last report, one every "
                      "%.0fs at most)", endpoint, os.strerror(err), self._failed_accepts,
                      LOG_EVERY_S)
            self._failed_accepts, self._failed_reported_at = 0, now

    def _over_share(self, fd: int, tcp: bool) -> bool:
        """Whether the connection just accepted on ``fd`` (counted already) is past
        its share (module docstring)."""
        if fd >= self.limit - self.limit // 8:
            return True
        share = self.tcp_threshold if tcp else self.threshold
        if len(self._open) <= share:
            return False
        now = time.monotonic()
        if now >= self._checked_until:  # drop what is no longer a socket, then judge
            self._checked_until = now + 1.0
            self._open = {(t, f) for t, f in self._open if _is_socket(f)}
        return len(self._open) > share

    def _refuse(self, fd: int, endpoint: str) -> None:
        """Shut down the connection on ``fd`` if it still is one of ``endpoint``'s.

        The socket object wraps libzmq's descriptor without owning it (``detach``):
        closing it stays libzmq's job once it sees the connection end."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed since, or the number now names something else
            return
        try:
            if not _is_connection_of(sock, endpoint):
                return
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the peer is already gone
                return
        finally:
            sock.detach()
        self.refused += 1
        self._sig[RankSlot.CONN_REFUSED] = self.refused
        if endpoint.startswith("ipc://"):
            self._close_door(endpoint[len("ipc://"):])
        now = time.monotonic()
        if now - self._reported_at >= LOG_EVERY_S:
            log.warning("refused %d connection(s) on %s since the last report (one every %.0fs "
                        "at most): %d connections were open, and they may use a quarter of the "
                        "open-file limit of %d (the newest got descriptor %d); find the peer "
                        "holding idle connections, or raise the hard open-file limit "
                        "(ulimit -Hn, systemd LimitNOFILE=)", self.refused - self._reported,
                        endpoint, LOG_EVERY_S, len(self._open), self.limit, fd)
            self._reported_at = now
            self._reported = self.refused

    def _close_door(self, path: str) -> None:
        if path in self._closed_doors:
            return
        try:
            os.rename(path, path + ".refusing")
        except OSError as exc:
            log.error("cannot rename %s away to turn new connections back: %s", path, exc)
            return
        self._closed_doors[path] = time.monotonic() + DOOR_S

    def _open_door(self, path: str) -> None:
        del self._closed_doors[path]
        try:
            os.rename(path + ".refusing", path)
        except OSError as exc:
            log.error("cannot rename %s back: %s; new connections fail until the daemon "
                      "restarts", path, exc)
