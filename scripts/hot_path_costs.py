"""Microseconds per call of the steps a client and a daemon take for one 1-block
evict, each timed alone with ``timeit`` under the daemon's malloc settings
(docs/benchmarks.md, "Daemon per-task work").  A diagnosis, not a target: the
steps' sum is the floor of each side's Python work per task; `kvswap bench
tasks` and `kvswap bench control` measure the whole.

Usage: .venv/bin/python scripts/hot_path_costs.py [--calls N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import timeit

import msgpack
import numpy as np

from kvswap.client.errors import ErrorCode
from kvswap.client.naming import Names
from kvswap.client.protocol import (
    Op,
    as_block_ids,
    decode_request,
    decode_transfer,
    encode_reply,
    packb,
    transfer_message,
    validate_transfer,
)
from kvswap.client.rings import record_bytes
from kvswap.client.signals import (
    ERROR_SLOTS,
    HIST_OPS,
    HIST_PHASES,
    HIST_SLOTS,
    RANK_SLOTS,
    RankSignals,
    RankSlot,
    RankStats,
)
from kvswap.daemon import malloc_tuning
from kvswap.daemon.journal import Journal
from kvswap.daemon.scheduler import Scheduler

REPLY = {"v": [1, 8], "id": 123, "rank": 0, "ok": True, "code": 0, "message": "",
         "tq": 1.5, "tx": 3.2, "bytes": 65536, "merged": 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls timed per step")
    n = parser.parse_args().calls
    print(malloc_tuning.tune())

    def show(name: str, fn) -> None:
        print(f"{name:38s} {timeit.timeit(fn, number=n) / n * 1e6:7.2f} us")

    dev, host = np.array([5], "<i4"), np.array([7], "<i4")
    # the client's side of a submit (the engine process)
    show("client: as_block_ids x2", lambda: (as_block_ids([5], "d"), as_block_ids([7], "h")))
    show("client: transfer_message + frames", lambda: transfer_message(
        Op.EVICT, 123, dev, host, 0, False).frames([1], None, 5, 9))
    sent = transfer_message(Op.EVICT, 123, dev, host, 0, False).frames([1], None, 5, 9)
    show("client: ring record size", lambda: record_bytes(sent))
    # the daemon's
    frames = [bytes(memoryview(f)) for f in
              transfer_message(Op.EVICT, 123, dev, host, 0, False).frames()]
    req = decode_request(frames)
    show("decode_request", lambda: decode_request(frames))
    show("decode_transfer", lambda: decode_transfer(req))
    show("validate_transfer", lambda: validate_transfer(Op.EVICT, dev, host, 4096, 4096))
    show("encode_reply", lambda: encode_reply(123, 0, ErrorCode.OK, "", 1.5, 3.2,
                                              bytes=65536, merged=4))
    show("msgpack.packb (a Packer per call)", lambda: msgpack.packb(REPLY, use_bin_type=True))
    show("protocol.packb (this thread's Packer)", lambda: packb(REPLY))

    with tempfile.TemporaryDirectory() as run_root:
        journal = Journal.open(Names(f"hotpath{os.getpid()}", run_root=run_root), 0,
                               n, 40 << 20)
        try:
            for cs in range(1, n + 1):  # a full ring of DONE records: each admit retires one
                journal.finish(journal.admit(1, Op.EVICT, dev, host, cid=5, cs=cs), ErrorCode.OK)
            seqs: list[int] = []
            show("journal admit", lambda: seqs.append(
                journal.admit(1, Op.EVICT, dev, host, cid=5, cs=n + len(seqs) + 1)))
            it = iter(seqs)
            show("journal finish", lambda: journal.finish(next(it), ErrorCode.OK, "",
                                                          {"bytes": 65536, "merged": 4}))
        finally:
            journal.close(unlink=True)

    sig = RankSignals(0, np.zeros(RANK_SLOTS, "<u8"))
    show("signal slot add", lambda: sig.add(RankSlot.COMPLETED, 1))
    stats = RankStats(np.zeros((len(HIST_OPS), len(HIST_PHASES), HIST_SLOTS), "<u8"),
                      np.zeros(ERROR_SLOTS, "<u8"))
    show("histogram record", lambda: stats.record(1, 0, 123.4))

    sched = Scheduler(4096, 4096, lambda batch: None, workers=1)
    try:
        tasks = []
        ids = [np.array([i % 4096], "<i4") for i in range(n)]
        show("scheduler submit (claimed)", lambda: tasks.append(
            sched.submit(Op.EVICT, ids[len(tasks)], ids[len(tasks)], claim_if_alone=True)))
        it2 = iter(tasks)
        show("scheduler finish", lambda: sched.finish([next(it2)]))
    finally:
        sched.stop()
        sched.join(5)


if __name__ == "__main__":
    main()
