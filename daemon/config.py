"""The options of ``kvswapd`` and ``kvswap launch``, each declared once.

    NamespaceOptions     --namespace --run-root        (also kvswap status / metrics)
      DaemonOptions      every kvswapd option that is the same on every rank
        DaemonConfig     + --rank --tp --device --listen-tcp: one kvswapd
        LaunchConfig     + --tp --devices --tcp, timeouts, restart policy: kvswap launch

``LaunchConfig`` extends ``DaemonOptions``, so every rank-independent kvswapd
option is also a ``kvswap launch`` flag, and :meth:`LaunchConfig.daemon_config`
derives each rank's ``DaemonConfig`` from it; the launcher writes that config
as kvswapd's command line with :func:`~kvswap.daemon.options.to_argv`, which
kvswapd parses back to an equal config.  The per-rank options are the ones the
launcher computes: ``--rank``, ``--device`` (from ``--devices``) and
``--listen-tcp`` (from ``--tcp``).

The parsers, help texts and the flag tables of docs/operations.md are generated
from these fields (:mod:`kvswap.daemon.options`); after a change here,
``python -m kvswap.daemon.config docs/operations.md`` rewrites the tables
(tests/test_config.py holds them equal).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from kvswap.client.layout import DEMO_LAYOUT_HELP, parse_demo_layout
from kvswap.client.errors import InvalidTask, NamespaceError
from kvswap.client.protocol import check_model_version
from kvswap.client.naming import NAMESPACE_RULE, Names, is_valid_namespace, tcp_endpoints
from kvswap.daemon import docblocks
from kvswap.daemon.options import (
    Options,
    at_least,
    between,
    format_size,
    markdown_table,
    nested,
    non_negative,
    option,
    parse_size,
    seconds,
    seconds_or_zero,
)
from kvswap.daemon.storage import check_url
from kvswap.daemon.supervisor import SupervisorConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_HOST_BLOCKS = 1024  # the pool size without --host-blocks or --host-size
MAX_RANKS = 1024  # what one signal segment holds (SignalSegment.create)


def _namespace_problem(name: str) -> str | None:
    return None if is_valid_namespace(name) else f"must be {NAMESPACE_RULE}, got {name!r}"


def layout_problem(spec: str) -> str | None:
    try:
        parse_demo_layout(spec)
    except ValueError as exc:
        return f"is not a valid LAYOUT: {exc}"
    return None


def _listen_problem(url: str) -> str | None:
    return None if url.startswith("tcp://") else f"must be a tcp://HOST:PORT address, got {url!r}"


def _tcp_problem(spec: str) -> str | None:
    try:
        tcp_endpoints(spec, 1)
    except ValueError:
        return f"must be HOST:BASEPORT with BASEPORT from 1 to 65534, got {spec!r}"
    return None


def _devices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expects a list of GPU ordinals like 0,1, got {text!r}") from None


def _devices_problem(devices: list[int]) -> str | None:
    if not devices or any(d < 0 for d in devices):
        return f"must list one GPU ordinal >= 0 per rank, got {devices}"
    return None


# Options that several commands declare, with their own default where it differs.

def tp_option(default: Any = MISSING) -> Any:
    """``--tp`` (kvswapd, kvswap launch, kvswap demo)."""
    return option(default, flag="--tp",
                  help=f"number of ranks (tensor-parallel size), 1 to {MAX_RANKS}",
                  parse=int, check=between(1, MAX_RANKS))


def host_blocks_option(default: int | None) -> Any:
    """``--host-blocks`` (kvswapd and kvswap launch, kvswap demo)."""
    return option(default, flag="--host-blocks", parse=int, check=at_least(1),
                  default_text=None if default is not None else
                  f"{DEFAULT_HOST_BLOCKS} unless --host-size is given",
                  help="blocks of host swap space per cache tensor and rank")


def _storage_problem(url: str) -> str | None:
    try:
        check_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _model_version_problem(version: str) -> str | None:
    try:
        check_model_version(version)
    except InvalidTask as exc:
        return exc.message
    return None


def run_root_option() -> Any:
    """``--run-root`` (every command that finds a namespace)."""
    return option(
        None, flag="--run-root", metavar="DIR",
        help="parent of the namespace's run dir <run_root>/<ns>/ (sockets, logs); every "
             "process of a namespace must resolve the same one",
        default_text="$KVSWAP_RUN_ROOT, else $XDG_RUNTIME_DIR/kvswap, else /tmp/kvswap-<uid>")


@dataclass(kw_only=True)
class NamespaceOptions(Options):
    """namespace"""

    namespace: str = option(
        flag="--namespace", metavar="NS", check=_namespace_problem,
        help=f"name of one engine instance, owning its shm objects and run dir: {NAMESPACE_RULE}")
    run_root: str | None = run_root_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        try:  # the run dir's socket paths must fit: a usage error like any bad flag
            Names.of(self.namespace, self.run_root)
        except NamespaceError as exc:
            raise ValueError(exc.message) from None


MAX_WORKERS = 256  # copy threads per rank: past the cores and copy engines they only wait


def _workers_problem(v: int) -> str | None:
    """1 to :data:`MAX_WORKERS`: a host out of threads failed every daemon at start."""
    return None if 1 <= v <= MAX_WORKERS else (
        f"must be in [1, {MAX_WORKERS}] (transfer threads per rank; more only wait for the "
        f"same cores and copy engines), got {v}")


def _heartbeat_problem(v: float) -> str | None:
    """A duration of 10 ms at least: every 1 ns, an idle daemon used a third of a core."""
    problem = seconds(v)
    if problem is None and v < 0.01:
        problem = f"must be at least 0.01 (more often only burns a core), got {v}"
    return problem


def _engine_timeout_problem(v: float) -> str | None:
    """0 (never) or a duration twice the engine heartbeat's default interval at least:
    shorter, a live engine's namespace was torn down between two of its beats."""
    problem = seconds_or_zero(v)
    if problem is None and 0 < v < 1.0:
        problem = (f"must be 0 (never) or at least 1 second, twice the 0.5 s at which a "
                   f"CacheWorker beats by default, got {v}")
    return problem


def check_beats(interval_s: float, stale_s: float, flag: str, outcome: str) -> None:
    """A daemon's heartbeat must come well within the age at which it counts as silent:
    at or past it, a healthy daemon is found silent between every two beats (with
    --restart-stale-after, killed and restarted in a loop until its rank is FATAL).
    Twice per stale period leaves one late beat to a loaded machine."""
    if not interval_s * 2 <= stale_s:
        raise ValueError(f"--heartbeat-interval {interval_s:g} must be at most half of {flag} "
                         f"{stale_s:g} (a daemon whose heartbeat is older {outcome}): lower "
                         f"--heartbeat-interval or raise {flag}")


@dataclass(kw_only=True)
class DaemonOptions(NamespaceOptions):
    """kvswapd options (kvswap launch passes them to every rank's daemon)"""

    backend: str = option(
        "host", flag="--backend", choices=("host", "cuda"),
        help="host: simulated device in shared memory, no GPU; cuda: real GPUs through cupy")
    host_blocks: int | None = host_blocks_option(None)
    host_size: int | None = option(
        None, flag="--host-size", metavar="BYTES", parse=parse_size, check=at_least(1),
        format=str, default_text="none: --host-blocks",
        help="host swap space per rank in bytes (64GiB, 512MiB, 4096; units are powers of "
             "2), instead of --host-blocks: the pool holds the most blocks of every tensor "
             "that fit, header and alignment included, worked out at register when the "
             "block sizes are known")
    demo_caches: str | None = option(  # "" = the default layout; None = wait for a worker
        None, flag="--demo-caches", metavar="LAYOUT", const="", check=layout_problem,
        default_text="off: wait for a CacheWorker",
        help="create simulated caches instead of waiting for a CacheWorker to register; "
             "without LAYOUT the default layout. LAYOUT: " + DEMO_LAYOUT_HELP)
    attach_timeout_s: float = option(
        300.0, flag="--attach-timeout", parse=float, check=seconds,
        help="seconds the start-up barrier (every rank attached its caches) and the clear "
             "barrier wait for all ranks")
    heartbeat_interval_s: float = option(
        0.1, flag="--heartbeat-interval", parse=float, check=_heartbeat_problem,
        help="seconds between two heartbeats of a daemon in the signal segment (at least "
             "0.01: more often only burns a core)")
    stale_after_s: float = option(
        5.0, flag="--stale-after", parse=float, check=seconds,
        help="a rank whose heartbeat is older than this many seconds aborts the barriers and "
             "storage agreements the other ranks wait in, instead of leaving them to time out "
             "(not a restart: that is kvswap launch --restart-stale-after)")
    max_device_blocks: int = option(
        1 << 20, flag="--max-device-blocks", parse=int, check=at_least(1),
        help="most device blocks a worker may register; with --host-blocks it sizes the "
             "largest frame the sockets accept (8 bytes per block id, 32 per storage key), "
             "so a peer cannot make the daemon buffer larger ones (docs/protocol.md "
             "section 2)")
    workers: int = option(
        2, flag="--workers", parse=int, check=_workers_problem,
        help="transfer worker threads per rank (independent evicts and loads run concurrently)")
    merge: bool = option(
        True, flag="--no-merge", default_text="off: merging on",
        help="never merge independent queued tasks into one copy pass")
    max_merge_blocks: int = option(
        4096, flag="--max-merge-blocks", parse=int, check=at_least(1),
        help="most blocks one merged copy pass may carry")
    inline_max_bytes: int = option(
        256 << 10, flag="--inline-max-bytes", parse=int, check=non_negative,
        help="a ready task of at most this many bytes, with nothing else queued, is copied on "
             "the I/O thread, skipping two thread hand-offs (0 disables)")
    orphan_timeout_s: float = option(
        30.0, flag="--orphan-timeout", parse=float, check=seconds,
        help="exit when the launcher is gone and the engine heartbeat has been silent (or "
             "absent) this many seconds")
    secret_file: str | None = option(
        None, flag="--secret-file", metavar="FILE", default_text="none",
        help="shared secret (mode 0600, >= 16 bytes) that signs every message on tcp:// "
             "(kvswapd --listen-tcp, kvswap launch --tcp)")
    replay_window_s: float = option(
        60.0, flag="--replay-window", parse=float, check=seconds,
        help="a signed tcp:// request must be this many seconds fresh; a replay inside the "
             "window is refused; the daemon remembers every mac of the window, about 80 "
             "bytes each (5 MB at 1,000 signed requests a second over 60 s)")
    storage_url: str | None = option(
        None, flag="--storage", metavar="URL", default_text="none", check=_storage_problem,
        help="storage tier behind the host swap space: file:///DIR[?capacity_bytes=N] or "
             "redis://HOST:PORT/DB (docs/storage.md)")
    model_id: str = option(
        "default", flag="--model-id", metavar="ID",
        help="model identity mixed into every stored entry's name (with the cache layout), "
             "so two models never share entries")
    model_version: str = option(
        "", flag="--model-version", metavar="V", default_text="none",
        check=_model_version_problem,
        help="version of the weights, mixed into every stored entry's name with --model-id; "
             "the initial value of TransferClient.set_model_version, which changes it after "
             "a weight update so that entries of the old weights are never matched")
    storage_timeout_s: float = option(
        30.0, flag="--storage-timeout", parse=float, check=seconds,
        help="seconds a prefetch waits for the other ranks to agree")
    drain_timeout_s: float = option(
        60.0, flag="--drain-timeout", parse=float, check=seconds,
        help="seconds a clear, or a replacing register (an engine restart), waits for "
             "accepted tasks to finish; also the longest a daemon's stop may take: past "
             "it the daemon exits at once with status 3, releasing nothing, as after a "
             "kill -9")
    journal_records: int = option(
        65536, flag="--journal-records", parse=int, check=at_least(1),
        help="completion journal: how many finished tasks each rank remembers, so a task "
             "re-sent after a crash is answered, not run again (128 bytes each)")
    journal_mib: int = option(
        32, flag="--journal-mib", parse=int, check=at_least(1),
        help="completion journal: MiB per rank for the block ids of tasks not yet finished "
             "(a task whose ids do not fit while others run is refused with JOURNAL_FULL, one "
             "larger than all of it with INVALID_TASK)")
    peer_transfer: str | None = option(
        None, flag="--peer-transfer", choices=("tcp", "rdma"), default_text="off",
        help="start one Mooncake Transfer Engine per rank, registering its host pool, so "
             "that TransferClient.receive_into / send_to move host blocks between nodes "
             "(prefill -> decode, docs/pd.md); needs the [mooncake] extra")
    peer_host: str | None = option(
        None, flag="--peer-host", metavar="HOST",
        default_text="the --tcp (kvswapd: --listen-tcp) host, else 127.0.0.1",
        help="address other nodes reach this node's Transfer Engines and completion "
             "listeners at (written into tickets)")
    peer_timeout_s: float = option(
        30.0, flag="--peer-timeout", parse=float, check=seconds,
        help="seconds a peer push waits for each answer of the receiving daemon, and a "
             "receive waits for a sender that began to say it is done")
    log_level: str = option(
        "INFO", flag="--log-level", parse=str.upper, choices=LOG_LEVELS,
        help="daemon log level")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.host_blocks is not None and self.host_size is not None:
            raise ValueError("--host-blocks and --host-size both size the host pool: give one")
        check_beats(self.heartbeat_interval_s, self.stale_after_s, "--stale-after",
                    "aborts the barriers and agreements it is in")

    @property
    def pool_blocks(self) -> int | None:
        """Blocks per tensor of each rank's pool, or None when ``host_size`` sizes it."""
        if self.host_size is not None:
            return None
        return DEFAULT_HOST_BLOCKS if self.host_blocks is None else self.host_blocks

    @property
    def host_blocks_bound(self) -> int:
        """Most host blocks per tensor a rank may have: the frame limit is sized from it
        (client/protocol.py max_frame_bytes) before the pool exists.  With
        ``--host-size`` the count is known only at register, so it is bounded by
        ``--max-device-blocks`` and a register that would exceed it is refused."""
        blocks = self.pool_blocks
        return self.max_device_blocks if blocks is None else blocks

    def pool_text(self) -> str:
        """How the pool is sized, for logs: ``1024 blocks per tensor`` or ``64.00 GiB``."""
        if self.host_size is not None:
            return f"{format_size(self.host_size)} per rank"
        return f"{self.pool_blocks} blocks per tensor"


@dataclass(kw_only=True)
class DaemonConfig(DaemonOptions):
    """this rank (kvswap launch sets these for each rank)"""

    rank: int = option(flag="--rank", parse=int, check=at_least(0),
                       help="the rank this daemon serves, from 0 to --tp minus 1")
    tp_size: int = tp_option()
    device: int | None = option(
        None, flag="--device", parse=int, check=at_least(0), default_text="none",
        help="GPU ordinal (cuda backend; kvswap launch takes it from --devices)")
    listen_tcp: str | None = option(
        None, flag="--listen-tcp", metavar="tcp://HOST:PORT", check=_listen_problem,
        default_text="none: ipc:// only",
        help="also accept requests on this address; every message on it must be HMAC-SHA256 "
             "signed with --secret-file (kvswap launch takes it from --tcp)")

    @property
    def peer_address(self) -> str:
        """The host written into tickets: --peer-host, else the --listen-tcp host, else
        127.0.0.1."""
        if self.peer_host:
            return self.peer_host
        if self.listen_tcp:
            return self.listen_tcp[len("tcp://"):].rsplit(":", 1)[0]
        return "127.0.0.1"


@dataclass(kw_only=True)
class LaunchConfig(DaemonOptions):
    """launcher (kvswap launch only)"""

    tp: int = tp_option()
    devices: list[int] | None = option(
        None, flag="--devices", metavar="0,1,...", parse=_devices, check=_devices_problem,
        format=lambda ds: ",".join(map(str, ds)), default_text="none",
        help="GPU ordinal of each rank, --tp of them (kvswapd --device; cuda backend)")
    tcp: str | None = option(
        None, flag="--tcp", metavar="HOST:BASEPORT", check=_tcp_problem,
        default_text="none: ipc:// only",
        help="rank r also listens on tcp://HOST:BASEPORT+r, accepting only HMAC-SHA256 signed "
             "messages (kvswapd --listen-tcp; needs --secret-file)")
    log_dir: str | None = option(
        None, flag="--log-dir", metavar="DIR", default_text="the run dir, removed at teardown",
        help="where the per-rank logs rank<r>.log go (linked from the run dir, whose "
             "paths clients name in their errors)")
    ready_timeout_s: float = option(
        600.0, flag="--ready-timeout", parse=float, check=seconds,
        help="seconds to wait for every rank to be READY")
    stop_timeout_s: float = option(
        10.0, flag="--stop-timeout", parse=float, check=seconds,
        help="deadline in seconds of the staged stop: SIGTERM (a daemon's clean stop), "
             "SIGKILL at 80%%")
    engine_timeout_s: float = option(
        60.0, flag="--engine-timeout", parse=float, check=_engine_timeout_problem,
        help="once the engine has beaten, tear everything down if it stays silent this many "
             "seconds (0: never; at least 1: a CacheWorker beats every 0.5 s by default and "
             "refuses a heartbeat interval over half of it)")
    supervision: SupervisorConfig = nested(SupervisorConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tcp is not None:
            try:
                tcp_endpoints(self.tcp, self.tp)
            except ValueError:  # the format passed: the last rank's port is out of range
                raise ValueError(f"--tcp {self.tcp}: BASEPORT + --tp must be at most 65535, "
                                 f"one port per rank") from None
            if not self.secret_file:
                raise ValueError("--tcp needs --secret-file")
        if self.devices is not None and len(self.devices) != self.tp:
            raise ValueError(f"--devices names {len(self.devices)} devices for --tp {self.tp}")
        check_beats(self.heartbeat_interval_s, self.supervision.stale_after_s,
                    "--restart-stale-after", "is killed and restarted")

    def daemon_config(self, rank: int, run_root: str) -> DaemonConfig:
        """Rank ``rank``'s daemon: every shared option as launched, ``run_root`` resolved."""
        shared = {f.name: getattr(self, f.name) for f in fields(DaemonOptions)}
        return DaemonConfig(
            **{**shared, "run_root": run_root}, rank=rank, tp_size=self.tp,
            device=None if self.devices is None else self.devices[rank],
            listen_tcp=None if self.tcp is None else tcp_endpoints(self.tcp, self.tp)[rank])


def operations_tables() -> dict[str, str]:
    """The generated flag tables of docs/operations.md, by marker name."""
    def taken_by(cls: type) -> str:
        if cls is DaemonConfig:
            return "`kvswapd`"
        if cls is NamespaceOptions:
            return "`kvswap launch`, `kvswapd`, `kvswap status`, `kvswap metrics`"
        if cls is DaemonOptions:
            return "`kvswap launch`, `kvswapd`"
        return "`kvswap launch`"

    return {
        "launch-flags": markdown_table([NamespaceOptions, LaunchConfig], taken_by),
        "daemon-flags": markdown_table([DaemonOptions, DaemonConfig], taken_by),
    }


def fill_generated(text: str) -> str:
    """``text`` (docs/operations.md) with each generated table replaced by the current
    one (the blocks of :mod:`kvswap.daemon.docblocks`)."""
    return docblocks.fill(text, operations_tables())


if __name__ == "__main__":
    # python -m kvswap.daemon.config docs/operations.md: rewrite its flag tables.
    import sys
    from pathlib import Path

    doc = Path(sys.argv[1])
    doc.write_text(fill_generated(doc.read_text()))
