"""kvswapd's glibc malloc settings (daemon/malloc_tuning.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvswap.daemon import malloc_tuning
from kvswap.daemon.malloc_tuning import Trimmer

from conftest import SMALL_LAYOUT


def test_the_trimmer_trims_at_most_once_per_period():
    now = [100.0]
    calls = []
    t = Trimmer(every_s=5.0, trim=lambda: calls.append(now[0]) or True, clock=lambda: now[0])
    for step in range(0, 120):  # a heartbeat every 0.1 s for 12 s
        now[0] = 100.0 + step / 10
        t.maybe()
    assert calls == [105.0, 110.0]


@pytest.mark.skipif(malloc_tuning.glibc() is None, reason="not glibc")
def test_tune_applies_both_settings_on_glibc():
    # In a child: the settings are process-wide and must not leak into the test run.
    code = ("from kvswap.daemon import malloc_tuning as m\n"
            "print(m.tune()); print(m.trim() in (True, False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out[0].startswith("malloc: glibc ") and "mmap threshold 128 KiB, 2 arenas" in out[0]
    assert out[1] == "True"


def test_kvswapd_applies_them_at_start(namespaces):
    launcher = namespaces.launch(tp=1, demo_caches=SMALL_LAYOUT)
    log = launcher.names.log_path(0).read_text()
    want = "2 arenas" if malloc_tuning.glibc() is not None else "not glibc"
    assert any("malloc: " in line and want in line for line in log.splitlines()), log
