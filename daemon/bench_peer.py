"""``kvswap bench peer``: node-to-node transfer (send_to / receive_into) against raw
Transfer Engine writes of the same bytes between the same registered buffers.

Two namespaces on this host stand for a prefill and a decode node (loopback TCP
unless ``--protocol rdma``).  For each TP size and block size, every round moves
``--mib`` MiB per rank of scattered host blocks:

* **peer**: ``receive_into`` on the decode namespace, ``send_to`` on the prefill
  namespace, until both futures complete (the whole path: tickets, the peer ops,
  hazard ordering, begin / write / done, the journal);
* **raw**: a Transfer Engine in this process, with the prefill namespace's pools
  mapped and registered, writes the same spans (same coalescing, one thread per
  rank as the daemons run) into the decode daemons' pools with one
  ``batch_transfer_sync_write`` per rank.  Nothing else: no ticket, no
  completion message.

The two alternate inside each round; the report gives the medians, their ratio
(target: peer >= 0.7 x raw), and the p50 latency of a one-block transfer both ways.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

from kvswap.client.errors import ErrorCode, KvswapError
from kvswap.client.peer_client import peer_infos
from kvswap.client.shm_region import ShmRegion
from kvswap.client.transfer_client import TransferClient
from kvswap.daemon.peer import PeerEngine, plan_spans
from kvswap.daemon.swap_space import SwapLayout

KIB = 1024
SIZES = (256 * KIB, 1024 * KIB)  # bytes of one block of one tensor
TARGET = 0.7


def _layout(block_bytes: int) -> str:
    """One layer (k and v) whose blocks have ``block_bytes`` bytes per tensor."""
    head_dim = block_bytes // (16 * 8 * 2)
    return f"layers=1,block_tokens=16,heads=8,head_dim={head_dim},dtype=float16,blocks=8"


class _RawWriter:
    """This process's Transfer Engine with the prefill pools registered: the reference."""

    def __init__(self, pre: TransferClient, dec: TransferClient, block_bytes: int,
                 host_blocks: int):
        self.engine = PeerEngine("127.0.0.1", "tcp")
        self.regions = [ShmRegion.attach(pre.names.swap_segment(r)) for r in range(pre.tp_size)]
        layout = SwapLayout.of_block_bytes([block_bytes, block_bytes], host_blocks)
        self._arrays = [reg.array(0, (reg.size,), np.uint8) for reg in self.regions]
        for a, reg in zip(self._arrays, self.regions):
            self.engine.register(int(a.ctypes.data), reg.size)
        self.src_bases = [[int(a.ctypes.data) + off for off in layout.offsets]
                          for a in self._arrays]
        self.dst, _ = peer_infos(dec)
        self.block_bytes = (block_bytes, block_bytes)

    def write(self, src: np.ndarray, dst: np.ndarray) -> None:
        def one(r: int) -> None:
            srcs, dsts, lens = plan_spans(self.src_bases[r], self.dst[r].bases,
                                          self.block_bytes, src, dst)
            self.engine.write(self.dst[r].te, srcs, dsts, lens)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(self.dst))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        self.engine.unregister_all()
        self._arrays = []
        for reg in self.regions:
            reg.close()


def _peer(pre: TransferClient, dec: TransferClient, src: np.ndarray, dst: np.ndarray) -> None:
    ticket, received = dec.receive_into(dst)
    sent = pre.send_to(ticket, src)
    sent.result()
    received.result()


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(tp: int, block_bytes: int, mib: int, rounds: int, protocol: str,
          latency_samples: int, seed: int) -> dict:
    from kvswap.daemon.bench import _Namespace

    per_block = 2 * block_bytes
    n = max(1, (mib << 20) // per_block)
    host_blocks = 2 * n
    rng = np.random.default_rng(seed)
    opts = {"peer_transfer": protocol}
    with _Namespace(tp, _layout(block_bytes), host_blocks, **opts) as pre, \
            _Namespace(tp, _layout(block_bytes), host_blocks, **opts) as dec:
        raw = _RawWriter(pre, dec, block_bytes, host_blocks)
        try:
            peer_s, raw_s = [], []
            for i in range(rounds):
                src = rng.permutation(host_blocks)[:n]
                dst = rng.permutation(host_blocks)[:n]
                pair = [("peer", lambda: _peer(pre, dec, src, dst)),
                        ("raw", lambda: raw.write(src, dst))]
                for name, fn in (pair if i % 2 == 0 else pair[::-1]):
                    (peer_s if name == "peer" else raw_s).append(_timed(fn))
            total = n * per_block * tp
            result = {"tp": tp, "block_kib": block_bytes // KIB, "blocks": n,
                      "mib_per_rank": round(n * per_block / 2**20, 1),
                      "peer_gbps": round(total / statistics.median(peer_s) / 1e9, 3),
                      "raw_gbps": round(total / statistics.median(raw_s) / 1e9, 3)}
            result["ratio"] = round(result["peer_gbps"] / result["raw_gbps"], 3)
            if latency_samples:
                one_src, one_dst = np.array([1]), np.array([2])
                peer_lat = [_timed(lambda: _peer(pre, dec, one_src, one_dst))
                            for _ in range(latency_samples)]
                raw_lat = [_timed(lambda: raw.write(one_src, one_dst))
                           for _ in range(latency_samples)]
                result["one_block_peer_p50_us"] = round(statistics.median(peer_lat) * 1e6, 1)
                result["one_block_raw_p50_us"] = round(statistics.median(raw_lat) * 1e6, 1)
            return result
        finally:
            raw.close()


def bench_peer(args: argparse.Namespace) -> dict:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        raise KvswapError(f"needs the Mooncake Transfer Engine ({exc}): pip install "
                          f"'kvswap[mooncake]'; apt-get install libibverbs1",
                          ErrorCode.PEER_DISABLED) from None
    rows = [_case(tp, size, args.mib, args.rounds, args.protocol,
                  args.latency_samples if (tp, size) == (1, SIZES[0]) else 0, args.seed)
            for tp in args.tp for size in args.sizes]
    worst = min(r["ratio"] for r in rows)
    return {"peer": rows, "summary": {"target_ratio": TARGET, "worst_ratio": worst,
                                      "meets_target": worst >= TARGET}}


def add_args(p: argparse.ArgumentParser) -> None:
    from kvswap.daemon.bench import _int_list

    p.add_argument("--tp", type=_int_list, default=[1, 2], metavar="1,2",
                   help="TP sizes, one prefill and one decode namespace each (default: 1,2)")
    p.add_argument("--sizes", type=lambda t: [int(x) * KIB for x in _int_list(t)],
                   default=list(SIZES), metavar="KIB,...",
                   help="bytes per block and tensor, in KiB (default: 256,1024)")
    p.add_argument("--mib", type=int, default=32, metavar="N", help="MiB moved per rank and round")
    p.add_argument("--rounds", type=int, default=5, metavar="N",
                   help="rounds per case, peer and raw alternating")
    p.add_argument("--latency-samples", type=int, default=50, metavar="N",
                   help="one-block transfers timed each way (TP 1, the smallest block size)")
    p.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp",
                   help="the Transfer Engine transport (rdma needs RDMA NICs)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the block sets")
