"""``CacheWorker``: the part of kvswap that lives in each engine TP worker.

The worker owns the rank's KV-cache tensors.  It exports them to the rank's
daemon (``register``) and writes the namespace's engine heartbeat, which lets
daemons tell a live engine from a dead one.

On the ``host`` backend the "GPU" tensors are shm segments that this worker
creates with :meth:`CacheWorker.alloc_host_tensor` and the daemon maps by name;
the worker unlinks them on :meth:`close` (it created them).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq

from kvswap.client.errors import ErrorCode, InvalidTask, KvswapError, RankTimeout, error_for_code
from kvswap.client.layer_progress import LayerProgress
from kvswap.client.layout import TensorDesc, validate_layout
from kvswap.client.naming import Names, check_tensor_name
from kvswap.client.protocol import (
    ID_LIMIT,
    MAX_HEADER_BYTES,
    MAX_SECONDS,
    Op,
    Reply,
    check_int,
    check_seconds,
    decode_reply,
    encode_request,
)
from kvswap.client.shm_region import ShmRegion
from kvswap.client.signals import HeaderSlot, SegmentClosed, SignalSegment, now_ns


@dataclass
class CacheTensor:
    """One cache tensor of a rank: blocks on axis 0, block-major contiguous."""

    name: str
    layer: int
    array: Any
    # The same bytes on every TP rank (an MLA latent cache): the storage tier stores it
    # once, from rank 0, and every rank prefetches it from there (docs/storage.md).
    replicated: bool = False


# Bounds of the worker's arguments: a rank index (the signal segment's own limit is
# lower: the namespace's tp_size), and the engine heartbeat's interval, which must stay
# well inside the launcher's --engine-timeout (default 60 s).
_MAX_RANK = 1 << 20
# A layer number goes on the wire as a msgpack int (the daemon takes any non-negative one).
_MAX_LAYER = ID_LIMIT - 1
_MIN_HEARTBEAT_S = 0.001
_MAX_HEARTBEAT_S = 30.0


class CacheWorker:
    def __init__(self, namespace: str, rank: int, run_root: str | None = None,
                 backend: str = "host", heartbeat_interval_s: float = 0.5):
        if backend not in ("host", "cuda"):
            raise ValueError(f"unknown backend {backend!r} (host, cuda)")
        # checked before anything is attached or started: a heartbeat thread that dies
        # on a bad interval would let the launcher tear the namespace down
        rank = check_int(rank, "rank", 0, _MAX_RANK)
        heartbeat_interval_s = check_seconds(heartbeat_interval_s, "heartbeat_interval_s",
                                             positive=True, most=_MAX_HEARTBEAT_S)
        if heartbeat_interval_s < _MIN_HEARTBEAT_S:
            raise InvalidTask(f"heartbeat_interval_s must be at least {_MIN_HEARTBEAT_S}s "
                              f"(shorter only burns a core), got {heartbeat_interval_s}",
                              ErrorCode.BAD_FIELD)
        self.names = Names.of(namespace, run_root)
        self.seg = SignalSegment.attach(self.names)
        if not 0 <= rank < self.seg.tp_size:
            tp = self.seg.tp_size
            self.seg.close()
            raise ValueError(f"rank {rank} out of range for namespace tp_size {tp}")
        engine_timeout_s = int(self.seg.header[HeaderSlot.ENGINE_TIMEOUT_MS]) / 1000
        if engine_timeout_s and heartbeat_interval_s * 2 > engine_timeout_s:
            self.seg.close()
            raise InvalidTask(
                f"heartbeat_interval_s {heartbeat_interval_s:g} must be at most half of the "
                f"namespace's --engine-timeout {engine_timeout_s:g}: the launcher tears the "
                f"namespace down when the engine has been silent that long, so a live engine "
                f"beating slower would lose it; beat more often, or launch with a longer "
                f"--engine-timeout", ErrorCode.BAD_FIELD)
        self.rank = rank
        self.backend = backend
        self._regions: dict[str, ShmRegion] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.names.endpoint(rank))
        self._closed = False
        self._closing = threading.Event()  # close() began: a register's wait gives up
        # layer number -> its index among the registered tensors' sorted distinct layers
        # (the index the daemon publishes progress in); replaced whole by register
        self._layers: dict[int, int] = {}
        self._progress = LayerProgress(self.seg, rank, owner="CacheWorker")
        self._hb_interval = heartbeat_interval_s
        self._hb_stop = threading.Event()
        self._registered = threading.Event()  # the heartbeat beats once this is set
        self._hb = threading.Thread(target=self._heartbeat, name="kvswap-engine-heartbeat",
                                    daemon=True)
        self._hb.start()

    def _heartbeat(self) -> None:
        """Beat once a register succeeded, never before: the launcher tears the namespace
        down when a heartbeat it has seen stops, so a worker whose register failed and
        that then closes must never have beaten (it would take the namespace with it
        ``--engine-timeout`` later)."""
        while not self._hb_stop.is_set():
            if self._registered.is_set():
                try:
                    self.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS] = now_ns()
                except SegmentClosed:
                    return  # close() gave up joining this thread and went on
            self._hb_stop.wait(self._hb_interval)

    # ------------------------------------------------------------------ host backend
    def alloc_host_tensor(self, name: str, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """Create a simulated device tensor in shm (host backend only), zero-filled."""
        if self.backend != "host":
            raise ValueError("alloc_host_tensor is for the host backend only")
        check_tensor_name(name)
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
            raise InvalidTask(f"shape must be a non-empty sequence of ints, got {shape!r:.60}",
                              ErrorCode.BAD_FIELD)
        dims = tuple(check_int(d, f"shape[{i}]", 1, 1 << 40) for i, d in enumerate(shape))
        try:
            dt = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidTask(f"dtype {dtype!r:.40} is not a numpy dtype: {exc}",
                              ErrorCode.BAD_FIELD) from None
        if dt.hasobject or dt.itemsize == 0:
            raise InvalidTask(f"dtype {dt} cannot live in shared memory: use a numeric dtype "
                              f"(uint8 for fp8 caches)", ErrorCode.BAD_FIELD)
        nbytes = math.prod(dims) * dt.itemsize  # Python ints: no silent wrap-around
        st = os.statvfs("/dev/shm")
        if nbytes > st.f_bavail * st.f_frsize:
            raise InvalidTask(f"tensor {name!r} of shape {dims} takes {nbytes} bytes, more than "
                              f"the {st.f_bavail * st.f_frsize} bytes free in /dev/shm: use a "
                              f"smaller shape, or make room (a larger /dev/shm)",
                              ErrorCode.BAD_FIELD)
        with self._lock:
            if self._closed:
                raise KvswapError("CacheWorker is closed", ErrorCode.SHUTTING_DOWN)
            if name in self._regions:
                raise ValueError(f"tensor {name!r} already allocated by this worker")
            region = ShmRegion.create(self.names.device_segment(self.rank, name), nbytes)
            self._regions[name] = region
        return region.array(0, dims, dt)

    def _describe(self, i: int, t: Any) -> TensorDesc:
        """Check ``tensors[i]`` and describe it for the daemon."""
        if not isinstance(t, CacheTensor):
            raise InvalidTask(f"tensors[{i}] must be a CacheTensor(name, layer, array), got "
                              f"{type(t).__name__} {t!r:.60}", ErrorCode.BAD_FIELD)
        # check_int refuses a float (1.7 must not quietly become layer 1), nan, None, a
        # bool: the layer decides which layer-wise wait the tensor's copy completes
        layer = check_int(t.layer, f"tensors[{i}] ({t.name!r:.60}): layer (the model layer "
                          f"number)", 0, _MAX_LAYER)
        if not isinstance(t.replicated, bool):
            raise InvalidTask(f"tensor {t.name}: replicated must be a bool, got "
                              f"{t.replicated!r:.40}", ErrorCode.BAD_LAYOUT)
        arr = t.array
        if self.backend == "cuda":
            # Imported here: it loads the CUDA driver only when a cuda worker registers.
            from kvswap.client.cuda_export import export_tensor

            exported = export_tensor(arr, t.name)
            return TensorDesc(t.name, layer, exported.dtype, exported.shape,
                              exported.location.to_wire(), t.replicated)
        if not isinstance(arr, np.ndarray):
            raise InvalidTask(f"tensor {t.name}: host backend expects the numpy array returned "
                              f"by alloc_host_tensor, got {type(arr).__name__}",
                              ErrorCode.BAD_LAYOUT)
        region = self._regions.get(t.name)
        if region is None:
            raise InvalidTask(f"tensor {t.name}: not allocated with alloc_host_tensor",
                              ErrorCode.BAD_LAYOUT)
        if not arr.flags.c_contiguous or arr.ndim < 1:
            raise InvalidTask(f"tensor {t.name}: must be C-contiguous with blocks on axis 0",
                              ErrorCode.BAD_LAYOUT)
        base = region.array(0, (1,), np.uint8)
        if arr.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
            raise InvalidTask(f"tensor {t.name}: array does not start at its shm segment",
                              ErrorCode.BAD_LAYOUT)
        # the inode tells the daemon which segment of that name (a restarted engine
        # creates its segments again under the same names)
        return TensorDesc(t.name, layer, arr.dtype.str, tuple(arr.shape),
                          {"shm": region.name, "ino": region.inode}, t.replicated)

    # ------------------------------------------------------------------ register
    def register(self, tensors: Sequence[CacheTensor], timeout: float = 60.0,
                 replace: bool = False) -> Reply:
        """Export the rank's cache tensors to its daemon.

        Returns once the daemon has attached them and created its host swap space.
        The rank reports READY when every rank has registered (start-up barrier).

        ``replace=True`` is for an engine restarted against a live namespace: this
        worker's tensors replace those of its dead predecessor.  The layout (names,
        layers, dtypes, block shapes) must be the one in effect; the daemon lets the
        tasks it accepted finish, attaches the new tensors and keeps its host pool
        with its contents (``reply.fields["host_pool_kept"]``), then is READY again
        without waiting for the other ranks.  On a rank whose daemon was restarted
        while the engine was down (nothing attached: its predecessor's tensors are
        gone) it adopts the host pool if the layout is the predecessor's
        (``host_pool_kept`` says whether it did) and joins the serving ranks, with or
        without ``replace``.  On a fresh namespace it is an ordinary register.  See
        docs/operations.md, "Engine restarts".
        """
        if self._closed:  # before the checks: the tensors it names are unlinked already
            raise KvswapError("CacheWorker is closed", ErrorCode.SHUTTING_DOWN)
        if not isinstance(replace, bool):
            raise ValueError(f"replace must be a bool, got {replace!r}")
        timeout = check_seconds(timeout, "timeout", positive=True)
        if isinstance(tensors, CacheTensor) or not isinstance(tensors, Sequence):
            raise InvalidTask(f"tensors must be a list of CacheTensor, got "
                              f"{type(tensors).__name__}", ErrorCode.BAD_FIELD)
        descs = [self._describe(i, t) for i, t in enumerate(tensors)]
        validate_layout(descs)
        fields = {"backend": self.backend, "tensors": [d.to_wire() for d in descs]}
        if replace:
            fields["replace"] = True
        reply = self._request(Op.REGISTER, fields, timeout, too_large=(
            f"it describes {len(descs)} tensor(s), each with its name twice (as the "
            f"tensor's and in its shm segment's name): register fewer, larger tensors "
            f"(blocks on axis 0, e.g. one per layer and kind) or shorter names"))
        self._layers = {layer: i for i, layer in enumerate(sorted({d.layer for d in descs}))}
        self.seg.header[HeaderSlot.ENGINE_HEARTBEAT_NS] = now_ns()  # the first beat, at once
        self._registered.set()
        return reply

    # ------------------------------------------------------------------ layer-wise loads
    def wait_layer(self, task_id: int, layer: int, timeout: float = 10.0) -> None:
        """Block until this rank's copy of ``layer`` for the layer-wise load
        ``task_id`` (``TransferFuture.task_id``) is complete and visible.

        Sleeps on the rank's layer semaphore (no busy wait); raises
        :class:`RankTimeout` naming the rank, task and layer, or
        :class:`TransferFailed` if the load failed on this rank.  ``layer`` is a layer
        number of the registered tensors (``CacheTensor.layer``), ``timeout`` a finite
        number of seconds (0: look once); a bad one raises :class:`InvalidTask`.

        :meth:`close` ends the wait at once (another thread may be in it): it raises
        :class:`KvswapError` SHUTTING_DOWN, as does a call after close."""
        task_id = check_int(task_id, "task_id (a layer-wise load's TransferFuture.task_id)",
                            1, ID_LIMIT - 1)
        layer = check_int(layer, "layer", 0, _MAX_LAYER)
        timeout = check_seconds(timeout, "timeout", positive=False, most=MAX_SECONDS)
        if self._closed:
            raise KvswapError("CacheWorker is closed", ErrorCode.SHUTTING_DOWN)
        layers = self._layers
        index = layers.get(layer)
        if index is None:
            if not layers:
                raise InvalidTask("wait_layer before register: this worker has no tensors "
                                  "registered, so no layer to wait for", ErrorCode.BAD_FIELD)
            raise InvalidTask(f"layer {layer} is not a layer of the registered tensors "
                              f"{sorted(layers)}", ErrorCode.BAD_FIELD)
        self._progress.wait(task_id, index, timeout, label=layer)

    def _request(self, op: Op, fields: dict, timeout: float, too_large: str = "") -> Reply:
        """Send one request and wait for its reply.  ``too_large`` says what made the
        header large and how to shrink it, for the error if it is over the daemon's
        limit: the daemon cannot read the id of such a request, so its refusal would
        answer nobody and this call would wait out its timeout."""
        with self._lock:
            if self._closed:
                raise KvswapError("CacheWorker is closed", ErrorCode.SHUTTING_DOWN)
            req_id = next(self._ids)
            frames = encode_request(op, req_id, fields)
            if len(frames[0]) > MAX_HEADER_BYTES:
                raise InvalidTask(
                    f"rank {self.rank}: the {op.value} request's header packs to "
                    f"{len(frames[0])} bytes, over the daemon's limit of {MAX_HEADER_BYTES} "
                    f"(kvswap.client.protocol.MAX_HEADER_BYTES)"
                    + (f"; {too_large}" if too_large else "") + "; nothing was sent",
                    ErrorCode.MESSAGE_TOO_LARGE)
            self._sock.send_multipart(frames)
            deadline = time.monotonic() + timeout
            while True:
                if self._closing.is_set():
                    raise KvswapError(f"CacheWorker closed while {op.value} waited for rank "
                                      f"{self.rank}'s answer", ErrorCode.SHUTTING_DOWN)
                remaining = deadline - time.monotonic()
                # in slices, so that close() from another thread ends the wait soon
                if remaining <= 0 or not self._sock.poll(min(int(remaining * 1000) + 1, 50)):
                    if time.monotonic() >= deadline:
                        raise RankTimeout(
                            f"rank {self.rank} did not answer {op.value} within {timeout:.1f}s "
                            f"(is the daemon running? log {self.names.log_path(self.rank)})")
                    continue
                reply = decode_reply(self._sock.recv_multipart()[0])
                if reply.id is None and not reply.ok:
                    # refused before its id could be read (a header that is not msgpack
                    # or too large).  This worker builds neither and sends one request at
                    # a time, so it is this one: waiting out the timeout cannot help.
                    raise error_for_code(reply.code, f"rank {self.rank}: {op.value} refused "
                                                     f"unread: {reply.message}")
                if reply.id != req_id:
                    continue  # a late reply to an earlier, timed-out request
                if not reply.ok:
                    raise error_for_code(reply.code, f"rank {self.rank}: {reply.message}")
                return reply

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop the heartbeat and unlink the tensors this worker created.

        Arrays returned by :meth:`alloc_host_tensor` stay valid until dropped.  A
        :meth:`wait_layer` in another thread ends with SHUTTING_DOWN, and the layer
        semaphore and signal segment are closed only once it has left.  A register
        waiting for its answer in another thread ends with SHUTTING_DOWN within 50 ms."""
        self._closing.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._hb_stop.set()
        self._hb.join(timeout=5)
        self._sock.close()
        self._ctx.term()
        with self._lock:  # no alloc_host_tensor runs now: it checks _closed under the lock
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.unlink()
            region.close()
        self._progress.close()
        self.seg.close()

    def __enter__(self) -> "CacheWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
