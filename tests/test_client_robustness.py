"""Client robustness: bad arguments cost one call, batches of any size, arrays that
outlive their worker, an I/O thread that survives its own bugs and concurrent
restarts, and the client half of exactly-once re-sends (cid / cs / re)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvswap.client.signals import RankState

from conftest import wait_for_state


# ------------------------------------------------------------------ CacheWorker arrays

_READ_AFTER_CLOSE = textwrap.dedent("""
    import gc, sys
    import numpy as np
    from kvswap.client import CacheWorker

    ns, root = sys.argv[1], sys.argv[2]

    def mapped(name):
        with open("/proc/self/maps") as f:
            return any(name.lstrip("/") in line for line in f)

    w = CacheWorker(ns, 0, run_root=root)
    arr = w.alloc_host_tensor("k0", (16, 1024), "uint8")
    seg = w.names.device_segment(0, "k0")
    view = arr[3:5]
    arr[:] = 7
    w.close()
    print("after close", int(arr.sum()), int(view[0, 0]), mapped(seg), flush=True)
    view[1, 2] = 9  # still writable memory, not a dangling pointer
    del arr
    gc.collect()
    print("view only", int(view.sum()), mapped(seg), flush=True)
    del view
    gc.collect()
    print("dropped", mapped(seg), flush=True)
""")


def test_host_tensor_stays_mapped_until_its_last_array_is_dropped(namespaces):
    """Reading an alloc_host_tensor array after CacheWorker.close() used to SIGSEGV the
    process: the array kept no hold on the mapping that close() unmapped."""
    launcher = namespaces.launch(tp=1, demo_caches=None, wait=False)
    wait_for_state(launcher, RankState.ATTACHING)
    names = launcher.names
    out = subprocess.run([sys.executable, "-c", _READ_AFTER_CLOSE, names.namespace,
                          str(names.run_root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"rc {out.returncode} (-11 is SIGSEGV): {out.stdout}{out.stderr}"
    assert out.stdout.splitlines() == [
        f"after close {7 * 16 * 1024} 7 True",
        f"view only {7 * 2 * 1024 + 2} True",  # the view alone keeps the mapping
        "dropped False",  # unmapped once no array refers to it
    ]
    assert not [e for e in names.owned_shm() if ".dev." in e]  # close() unlinked it all the same
