"""Request traces (Mooncake format, synthetic generator), the bookkeeping replay and the
``kvswap bench trace`` / ``kvswap bench hostcache`` commands."""

from __future__ import annotations

import io
import json
import os
import tempfile

import pytest

from kvswap.client import HostCache
from kvswap.daemon.bench_trace import (
    DevicePrefixCache,
    ReferenceLru,
    ReplaySetup,
    cycle_requests,
    replay_bookkeeping,
    replay_daemons,
    run_cycle,
)
from kvswap.daemon.cli import main
from kvswap.daemon.trace import (
    BLOCK_TOKENS,
    SyntheticConfig,
    TraceRequest,
    read_trace,
    synthetic_trace,
    trace_stats,
    parse_request,
    write_trace,
)


def test_synthetic_trace_is_seeded_and_well_formed():
    a = synthetic_trace(SyntheticConfig(requests=400, seed=7))
    assert a == synthetic_trace(SyntheticConfig(requests=400, seed=7))
    assert a != synthetic_trace(SyntheticConfig(requests=400, seed=8))
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    for r in a:
        assert len(set(r.hash_ids)) == len(r.hash_ids)
        assert (len(r.hash_ids) - 1) * BLOCK_TOKENS < r.input_length <= len(r.hash_ids) * 512
        assert len(r.hash_ids) <= SyntheticConfig().max_context_blocks


def test_synthetic_trace_has_shared_system_prompts_and_growing_conversations():
    reqs = synthetic_trace(SyntheticConfig(requests=600, seed=1, system_prompts=4))
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) <= 4  # every request starts with one of the system prompts
    # a later turn repeats an earlier request whole and appends to it
    by_prefix = {r.hash_ids: r for r in reqs}
    turns = [r for r in reqs if any(r.hash_ids[:k] in by_prefix
                                    for k in range(5, len(r.hash_ids)))]
    assert len(turns) > 100
    st = trace_stats(reqs)
    assert 0.3 < st["reuse_bound"] < 0.9 and st["requests"] == 600


def test_trace_file_round_trip(tmp_path):
    reqs = synthetic_trace(SyntheticConfig(requests=50))
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        write_trace(reqs, f)
    assert read_trace(path) == reqs


def test_mooncake_lines_with_extra_keys_are_read():
    path_text = ('{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [4, 9],'
                 ' "extra": 1}\n\n')
    buf = io.StringIO(path_text)
    assert parse_request(buf.readline(), "x") == TraceRequest(0, 700, 3, (4, 9))


@pytest.mark.parametrize("line,why", [
    ("not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "'hash_ids' must be a list"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, -2]}',
     "non-negative"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 1]}',
     "names a block twice"),
    ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
     "'timestamp' must be a non-negative integer"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}',
     "'input_length'"),
])
def test_bad_trace_lines_name_the_file_line_and_field(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [3]}\n'
                    + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl line 2: .*{why}"):
        read_trace(path)


def test_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no request"):
        read_trace(path)


@pytest.mark.parametrize("field,value", [("requests", 0), ("turn_blocks", (3, 1)),
                                         ("oneshot", 0.9), ("max_context_blocks", 2)])
def test_synthetic_config_is_checked(field, value):
    with pytest.raises(ValueError):
        synthetic_trace(SyntheticConfig(**{field: value}))


# ------------------------------------------------------------------ replay (bookkeeping)


def test_device_prefix_cache_evicts_least_recent_outside_the_request():
    d = DevicePrefixCache(4)
    d.place([1, 2, 3, 4])
    d.touch([1, 2, 3, 4])  # 1 most recent
    assert d.prefix_hits([1, 2, 9, 3]) == 2
    assert d.evict(2, keep={4}) == [(3, 2), (2, 1)]  # 4 is older but kept
    assert d.place([7, 8]) == [1, 2]  # the freed slots (the last freed first)


def test_bookkeeping_replay_counts_add_up():
    reqs = synthetic_trace(SyntheticConfig(requests=300, seed=2))
    c = replay_bookkeeping(reqs, ReplaySetup(48, 64, "lru", 1, None))
    assert c.requests == 300 and c.blocks == sum(len(r.hash_ids) for r in reqs)
    assert c.device_hits + c.host_hits + c.storage_hits + c.misses == c.blocks
    assert c.host_hits > 0 and c.storage_hits == 0
    with_storage = replay_bookkeeping(reqs, ReplaySetup(48, 64, "lru", 1, "auto"))
    assert with_storage.storage_hits > 0
    # an unbounded store behind the host tier turns misses into storage hits
    assert with_storage.misses < c.misses
    assert with_storage.host_hits + with_storage.storage_hits > c.host_hits


def test_more_host_blocks_never_lose_lru_host_hits_on_this_trace():
    reqs = synthetic_trace(SyntheticConfig(requests=400, seed=4))
    hits = [replay_bookkeeping(reqs, ReplaySetup(48, h, "lru", 1, None)).host_hits
            for h in (16, 64, 256)]
    assert hits == sorted(hits) and hits[0] < hits[-1]


def test_reference_lru_and_hostcache_agree_on_the_cycle():
    reqs = cycle_requests(300, 64, seed=5)
    ref, mine = ReferenceLru(1024), HostCache(1024)
    run_cycle(ref, reqs)
    run_cycle(mine, reqs)
    assert list(ref.blocks) == list(mine._index._blocks)  # same blocks, same order


# ------------------------------------------------------------------ commands


def test_bench_trace_command_json(capsys):
    assert main(["bench", "trace", "--synthetic", "--requests", "80", "--device-blocks", "48",
                 "--host-blocks", "32", "--tp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    real, ref = out["replay"]
    assert (real["mode"], ref["mode"]) == ("daemons", "bookkeeping")
    assert out["check"]["host_hits_equal"] is True and out["check"]["mismatched"] == 0
    assert real["tasks"] > 0 and real["bytes_moved"] > 0


def test_bench_trace_sweep_json(capsys):
    assert main(["bench", "trace", "--synthetic", "--requests", "200", "--device-blocks", "48",
                 "--sweep", "16,64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["host_blocks"] for r in rows] == [16, 64]
    assert all(0 <= r["lru_host_ratio"] <= 1 and 0 <= r["arc_host_ratio"] <= 1 for r in rows)


def test_bench_trace_reports_a_request_longer_than_the_device(capsys):
    assert main(["bench", "trace", "--synthetic", "--requests", "50", "--device-blocks", "8",
                 "--tp", "1"]) == 1
    assert "more than the 8 device blocks; raise --device-blocks" in capsys.readouterr().err


def test_bench_trace_reports_a_missing_trace_file(capsys, tmp_path):
    assert main(["bench", "trace", "--trace", str(tmp_path / "none.jsonl")]) == 1
    assert "none.jsonl" in capsys.readouterr().err


def test_bench_hostcache_command_json(capsys):
    assert main(["bench", "hostcache", "--requests", "200", "--rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in out["hostcache"]] == ["reference", "lru", "arc"]
    assert all(r["ns_per_block"] > 0 for r in out["hostcache"])


@pytest.mark.parametrize("argv", [
    ["trace", "--synthetic", "--requests", "100", "--device-blocks", "48", "--sweep", "16,32"],
    ["trace", "--synthetic", "--requests", "60", "--device-blocks", "48", "--tp", "1"],
    ["hostcache", "--requests", "100", "--rounds", "1"],
])
def test_bench_plots_are_png_files(tmp_path, capsys, argv):
    pytest.importorskip("matplotlib")
    path = tmp_path / "out.png"
    assert main(["bench", *argv, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_replay_refused_at_launch_leaves_no_directory(monkeypatch, tmp_path):
    """The run root and the store were made before the namespace's configuration was
    checked, outside the clean-up: a bad setup left both in /tmp."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kw):
        made.append(real(*args, **{**kw, "dir": str(tmp_path)}))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(ValueError, match="tp"):
        replay_daemons([], ReplaySetup(48, 64, "lru", 0, "auto"))
    assert len(made) == 2 and not any(os.path.exists(d) for d in made)
