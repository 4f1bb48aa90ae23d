"""`kvswap bench all`: the generated blocks of docs/benchmarks.md, and docblocks.

The quick run is real (every scenario, in its own process, at tiny sizes) and
writes into a copy of the doc; timings are never asserted, only that every block
was rewritten with its provenance line and well-formed tables, that the verdicts
agree with the targets, and that not a byte outside the blocks changed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.daemon import bench, bench_all, docblocks
from kvswap.daemon.bench_refs import BenchError
from kvswap.daemon.cli import build_parser, main

DOC = bench_all.DEFAULT_DOC
PROVENANCE = re.compile(
    r"^Measured at commit `(?P<commit>[0-9a-f]{7,}(?P<dirty>\+dirty)?)`, "
    r"\d{4}-\d\d-\d\d \d\d:\d\d UTC, on (?P<machine>.+, \d+ CPUs, \d+ GiB, Python [\d.]+); "
    r"load average [\d.]+ at the start\. Commands: (?P<commands>.+?)\.(?P<rest>.*)$")
TARGET = re.compile(r"^(>=|<=) -?[\d.]+( tasks/s| µs)?$")
_LEFTOVER = re.compile(r"bench-(\d+)-")


def _outside(text: str) -> list[str]:
    """The hand-written parts of ``text``: everything outside the generated blocks."""
    parts, pos = [], 0
    for start, end in docblocks.blocks(text).values():
        parts.append(text[pos:start])
        pos = end
    return [*parts, text[pos:]]


def _tables(body: str) -> list[list[list[str]]]:
    """Every markdown table of ``body``: header row, then data rows (cells stripped)."""
    tables, current = [], []
    for line in [*body.splitlines(), ""]:
        if line.startswith("|"):
            assert line.endswith(" |"), line
            current.append([c.strip() for c in line[1:-1].split(" | ")])
        elif current:
            tables.append(current)
            current = []
    out = []
    for rows in tables:
        header, sep, *data = rows
        assert set(sep) == {"---"} and len(sep) == len(header), rows[:2]
        assert data, f"a table without rows: {header}"
        assert all(len(r) == len(header) for r in data), rows
        out.append([header, *data])
    return out


def _dead_leftovers(before: set[str]) -> list[str]:
    """New /dev/shm entries of benches whose process is gone (other agents' live
    benches on this machine are not ours to judge)."""
    found = []
    for name in set(os.listdir("/dev/shm")) - before:
        m = _LEFTOVER.search(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            found.append(name)
    return found


def _git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(bench_all.CHECKOUT), *argv], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()


@pytest.mark.timeout(300)
def test_quick_run_rewrites_every_block_and_nothing_else(tmp_path):
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOC, doc)
    before = doc.read_text()
    shm_before = set(os.listdir("/dev/shm"))
    head, dirty = _git("rev-parse", "--short", "HEAD"), bool(_git("status", "--porcelain"))
    proc = subprocess.run([sys.executable, "-m", "kvswap.daemon.cli", "bench", "all", "--quick",
                           "--markdown", str(doc)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    after = doc.read_text()
    assert _outside(after) == _outside(before)  # not a byte of the prose changed
    blocks = docblocks.blocks(after)
    names = [s.name for s in bench_all.SECTIONS]
    assert [b for b in blocks if b.startswith("bench-")] == [f"bench-{n}" for n in names]
    gpu_missing = bench._gpu_unavailable()
    for name in names:
        start, end = blocks[f"bench-{name}"]
        body = after[start:end]
        assert body != before[slice(*docblocks.blocks(before)[f"bench-{name}"])]
        first, *rest = body.splitlines()
        m = PROVENANCE.match(first)
        assert m, first
        assert m["commit"] == head + ("+dirty" if dirty else "")
        assert "Quick run (`--quick`)" in m["rest"]
        assert f"### {name}\n\n{body.rstrip()}" in proc.stdout  # printed as written
        if name == "gpu" and gpu_missing is not None:
            assert m["commands"] == "none"
            assert "Not run: " in body and gpu_missing in body
            assert not _tables(body)
            continue
        assert all(c.startswith("`kvswap bench ") or c.startswith("`python scripts/bench_gpu")
                   for c in m["commands"].split("; "))
        tables = _tables("\n".join(rest))
        assert tables, name
        for header, *rows in tables:
            for row in rows:
                for i, col in enumerate(header):
                    if col == "met":
                        assert row[i] in ("met", "not met", "–"), row
                    if col == "target":
                        assert row[i] == "none" or TARGET.match(row[i]), row
                        assert (row[i] == "none") == (row[i + 1] == "–"), row
                    if col == "ratio" and header[i + 1] == "target" and row[i + 1] != "none":
                        # the verdict is the target applied to the figure beside it
                        cmp, bound = row[i + 1].split()[:2]
                        ok = (float(row[i]) >= float(bound) if cmp == ">="
                              else float(row[i]) <= float(bound))
                        assert row[i + 2] == ("met" if ok else "not met"), row
    assert not _dead_leftovers(shm_before)


def _fake_sections(monkeypatch, measures: dict[str, object]) -> None:
    """Replace how each section measures (``measures[name]``: a callable)."""
    monkeypatch.setattr(bench_all, "SECTIONS", tuple(
        dataclasses.replace(s, measure=measures[s.name]) for s in bench_all.SECTIONS))


def _never(quick: bool) -> bench_all.Measured:
    pytest.fail("measured although the doc was refused")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("<!-- end: bench-hostcache -->\n", ""),
     "block 'bench-hostcache' has no '<!-- end: bench-hostcache -->' line after it"),
    (lambda t: t.replace("<!-- end: bench-gpu -->\n", ""),
     "'<!-- generated: bench-trace -->' inside the block 'bench-gpu'"),
    (lambda t: re.sub(r"<!-- generated: bench-data -->\n.*?<!-- end: bench-data -->\n", "", t,
                      flags=re.S),
     "no block for '<!-- generated: bench-data -->'"),
    (lambda t: t + "\n<!-- generated: bench-nosuch -->\n<!-- end: bench-nosuch -->\n",
     "block(s) bench-nosuch belong to no section"),
    (lambda t: t.replace("<!-- generated: bench-tasks -->\n", ""),
     "'<!-- end: bench-tasks -->' without '<!-- generated: bench-tasks -->' before it"),
])
def test_bad_doc_is_refused_before_measuring(tmp_path, monkeypatch, capsys, edit, message):
    _fake_sections(monkeypatch, {s.name: _never for s in bench_all.SECTIONS})
    doc = tmp_path / "benchmarks.md"
    text = edit(DOC.read_text())
    doc.write_text(text)
    assert main(["bench", "all", "--markdown", str(doc)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(doc) in err
    assert doc.read_text() == text


def test_a_failing_section_leaves_the_doc_unchanged(tmp_path, monkeypatch, capsys):
    measured = []

    def ok(quick: bool) -> bench_all.Measured:
        measured.append(quick)
        return bench_all.Measured(None, [], ["Not run: a test."])

    def fails(quick: bool) -> bench_all.Measured:
        raise BenchError("floor rank 0 did not answer")

    _fake_sections(monkeypatch, {s.name: ok for s in bench_all.SECTIONS} | {"data": fails})
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOC, doc)
    text = doc.read_text()
    assert main(["bench", "all", "--quick", "--markdown", str(doc)]) == 1
    assert measured == [True]  # control ran, data failed, nothing after it ran
    assert "data: floor rank 0 did not answer" in capsys.readouterr().err
    assert doc.read_text() == text


def test_only_rewrites_the_named_blocks(tmp_path, monkeypatch):
    def note(quick: bool) -> bench_all.Measured:
        return bench_all.Measured(None, [], ["Not run: a test."])

    _fake_sections(monkeypatch, {s.name: note for s in bench_all.SECTIONS})
    doc = tmp_path / "benchmarks.md"
    shutil.copy(DOC, doc)
    before = doc.read_text()
    assert main(["bench", "all", "--only", "tasks,storage", "--markdown", str(doc)]) == 0
    after = doc.read_text()
    old, new = docblocks.blocks(before), docblocks.blocks(after)
    changed = [n for n in new if after[slice(*new[n])] != before[slice(*old[n])]]
    assert changed == ["bench-tasks", "bench-storage"]
    assert "Not run: a test." in after[slice(*new["bench-tasks"])]


def test_only_refuses_unknown_sections(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "all", "--only", "control,nosuch"])
    assert exc.value.code == 2
    assert "unknown section(s) ['nosuch']: choose from control,data" in capsys.readouterr().err


def test_control_targets_and_tp1_only_throughput_target():
    row = {"kvswap_p50_us": 300.0, "kvswap_p99_us": 500.0, "floor_p50_us": 200.0,
           "baseline_p50_us": 1800.0, "p50_vs_floor": 1.5, "baseline_vs_kvswap_p50": 6.0,
           "kvswap_tasks_per_s": 25000, "floor_tasks_per_s": 50000,
           "baseline_tasks_per_s": 900, "kvswap_cpu_us": 1, "floor_cpu_us": 1,
           "baseline_cpu_us": 1, "tasks_per_system": 10, "path": "ring", "engine_cpu_us": 70,
           "engine_cpu_pipelined_us": 50}
    lines = bench_all.render_control({"control": [
        {**row, "tp": 1}, {**row, "tp": 2, "p50_vs_floor": 2.5, "baseline_vs_kvswap_p50": 4.0}]})
    (lat_head, *lat), (thr_head, *thr) = _tables("\n".join(lines))
    assert [r[5:8] for r in lat] == [["1.5", "<= 2", "met"], ["2.5", "<= 2", "not met"]]
    assert [r[8:11] for r in lat] == [["6.0", ">= 5", "met"], ["4.0", ">= 5", "not met"]]
    assert [r[4:7] for r in thr] == [["0.5", ">= 20000 tasks/s", "met"], ["0.5", "none", "–"]]
    assert [r[11:16] for r in thr] == [["ring", "70", "<= 80 µs", "met", "50"],
                                       ["ring", "70", "none", "–", "50"]]


def test_gpu_table_reads_the_rows_bench_gpu_writes(monkeypatch):
    """No GPU here: the rows are made by scripts/bench_gpu.py's own Row, as its --json does."""
    spec = importlib.util.spec_from_file_location("bench_gpu", bench.GPU_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", script)
    spec.loader.exec_module(script)
    rows = [script.Row("evict", "scattered", 4, 8, 2048, 64.0, 20.0, 25.0),
            script.Row("load", "contiguous", 64, 8, 128, 64.0, 26.0, 25.0)]
    result = {"device": "NVIDIA H100", "tensors": 8, "task_mib": 64, "reps": 7,
              "rows": [dict(dataclasses.asdict(r), ratio=r.ratio) for r in rows], "sweep": [],
              "suggested_memcpy_run_blocks": {"evict 16 KiB": 8, "load 16 KiB": None}}
    lines = bench_all.render_gpu(result)
    assert lines[0] == "Device: NVIDIA H100, 8 tensors per task."
    ((header, *table),) = _tables("\n".join(lines))
    assert [r[header.index("ratio")] for r in table] == ["0.8", "1.04"]
    assert "evict 16 KiB: 8; load 16 KiB: never." in lines[-1]


# ---------------------------------------------------------------------- docblocks


def test_fill_replaces_named_blocks_only():
    text = ("intro\n<!-- generated: a -->\nold a\n<!-- end: a -->\nmiddle\n"
            "<!-- generated: b -->\nold b\n<!-- end: b -->\n<!-- generated: c -->\n"
            "<!-- end: c -->\nend\n")
    out = docblocks.fill(text, {"a": "new a\n\n", "c": "new c"})
    assert out == ("intro\n<!-- generated: a -->\nnew a\n<!-- end: a -->\nmiddle\n"
                   "<!-- generated: b -->\nold b\n<!-- end: b -->\n<!-- generated: c -->\n"
                   "new c\n<!-- end: c -->\nend\n")
    assert docblocks.fill(out, {"a": "new a", "c": "new c"}) == out  # idempotent


@pytest.mark.parametrize("text, message", [
    ("<!-- generated: a -->\n<!-- generated: b -->\n<!-- end: b -->\n",
     "line 2: '<!-- generated: b -->' inside the block 'a' (opened on line 1)"),
    ("<!-- generated: a -->\n<!-- end: a -->\n<!-- generated: a -->\n<!-- end: a -->\n",
     "line 3: a second block 'a'"),
    ("x\n<!-- end: a -->\n", "line 2: '<!-- end: a -->' without '<!-- generated: a -->'"),
    ("x\n<!-- generated: a -->\ny\n", "line 2: block 'a' has no '<!-- end: a -->'"),
])
def test_malformed_blocks_name_the_line(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        docblocks.blocks(text)


def test_fill_of_a_missing_block_changes_nothing():
    with pytest.raises(ValueError, match=re.escape("no '<!-- generated: b -->' ... "
                                                   "'<!-- end: b -->' block")):
        docblocks.fill("<!-- generated: a -->\n<!-- end: a -->\n", {"a": "x", "b": "y"})


def test_bench_gpu_json_flag_is_one_bench_gpu_accepts(monkeypatch):
    """``kvswap bench gpu --json`` runs bench_gpu.py with arguments its parser takes, and
    ``--json -`` means stdout (it used to pass a bare ``--json``, which needs a file)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", bench.GPU_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", script)
    spec.loader.exec_module(script)
    cmd = bench.gpu_command(as_json=True)
    assert cmd[1] == str(bench.GPU_SCRIPT)
    assert script.parse_args(cmd[2:]).json == "-"
    assert script.parse_args(bench.gpu_command(as_json=False)[2:]).json is None
