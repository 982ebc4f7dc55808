"""Where the CPU goes: process CPU time of the consumer, PostgreSQL and the broker, from /proc.

A :func:`snapshot` reads, in clock ticks turned into seconds:

* ``self``: this process (all its threads: librdkafka's too);
* ``postgres``: the postmaster and its children that serve every database
  (WAL writer, checkpointer, autovacuum...) plus the backends connected to
  *our* database; backends of other databases (other people's test runs on
  the same server) are counted apart, as ``postgres_other_databases``, and
  fall into "other". Per process, so a backend that starts mid-window counts
  whole; one that ends mid-window loses its last part (the bench's
  connections live through their window);
* ``broker``: the Kafka broker's JVM;
* ``machine``: busy and total CPU time of the whole machine (``/proc/stat``),
  so other load (test runs, another benchmark) shows as "other".

:func:`delta` turns two snapshots into seconds per part. PostgreSQL serves
every database on the server: other sessions *in our database* count as
``postgres`` too; the machine line shows how busy the box was.

Linux only; on another system every figure is ``None``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ROOT = Path(__file__).resolve().parent.parent
PG_PIDFILE = ROOT / ".local" / "postgres" / "data" / "postmaster.pid"
KAFKA_PIDFILE = ROOT / ".local" / "kafka" / "kafka.pid"


@dataclass(frozen=True)
class Snapshot:
    at: float
    self_cpu: float | None
    postgres: dict[int, tuple[str, float]] | None  # pid -> (ours | other, CPU seconds)
    broker: float | None
    machine_busy: float | None
    machine_total: float | None


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    return text[text.rfind(")") + 2 :].split()


def _cpu(fields: list[str], children: bool = False) -> float:
    # fields[0] is state (field 3); utime, stime = fields 14, 15; cutime, cstime = 16, 17.
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None:
            kids.setdefault(int(fields[1]), []).append(int(entry.name))
    return kids


def _children_of(pid: int) -> list[int]:
    try:  # cheap where the kernel has it (CONFIG_PROC_CHILDREN)
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return _children().get(pid, [])


def _pid_from(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _find(comm: str, needle: str) -> int | None:
    """The first process named ``comm`` whose command line contains ``needle``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if Path(entry.path, "comm").read_text().strip() != comm:
                continue
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if needle.encode() in cmdline:
            return int(entry.name)
    return None


# Server processes that serve every database (no database of their own).
_AUX = ("checkpointer", "background", "walwriter", "autovacuum", "logical", "archiver",
        "stats", "startup", "walsender", "walreceiver", "io", "parallel")


def _pg_class(pid: int, database: str) -> str:
    """``ours`` for the server's own processes and backends of ``database``; else ``other``."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace").split()
    except OSError:
        return "other"
    # "postgres: <user> <database> <host> <activity>" or "postgres: <aux process name>"
    if len(words) < 2 or words[1].startswith(_AUX):
        return "ours"
    if len(words) >= 3:
        return "ours" if words[2] == database else "other"
    return "ours"


class Pids:
    """The postmaster and broker pids, found once (pid files first, then /proc), and the
    database whose backends count as "ours"."""

    def __init__(self, database: str = "kafka_idem") -> None:
        self.database = database
        self.postmaster = _pid_from(PG_PIDFILE) or _find("postgres", " -D ")
        self.broker = _pid_from(KAFKA_PIDFILE) or _find("java", "kafka")
        if self.broker is not None and _stat(self.broker) is None:
            self.broker = _find("java", "kafka")


def snapshot(pids: Pids, *, self_pid: int | None = None) -> Snapshot:
    """CPU seconds so far; ``self_pid`` (default: this process) is the consumer."""
    if not Path("/proc/stat").exists():
        return Snapshot(time.perf_counter(), None, None, None, None, None)
    me = _stat(self_pid or os.getpid())
    postgres: dict[int, tuple[str, float]] | None = None
    if pids.postmaster is not None and (top := _stat(pids.postmaster)) is not None:
        postgres = {pids.postmaster: ("ours", _cpu(top))}
        for child in _children_of(pids.postmaster):
            if (f := _stat(child)) is not None:
                postgres[child] = (_pg_class(child, pids.database), _cpu(f))
    broker = None
    if pids.broker is not None and (b := _stat(pids.broker)) is not None:
        broker = _cpu(b)
    line = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in line]
    total = sum(ticks[:8])  # guest time is already inside user/nice
    idle = ticks[3] + ticks[4]  # idle + iowait
    return Snapshot(
        at=time.perf_counter(),
        self_cpu=_cpu(me) if me is not None else None,
        postgres=postgres,
        broker=broker,
        machine_busy=(total - idle) / TICK,
        machine_total=total / TICK,
    )


def _pg_delta(a: Snapshot, b: Snapshot) -> tuple[float | None, float | None]:
    """CPU of PostgreSQL processes between the snapshots: (ours, other databases). A process
    that started in between counts whole; one that ended before ``b`` is counted up to
    where ``b`` last saw it (see :class:`Watch`)."""
    if a.postgres is None or b.postgres is None:
        return None, None
    sums = {"ours": 0.0, "other": 0.0}
    for pid, (cls, cpu) in b.postgres.items():
        sums[cls] += max(cpu - a.postgres.get(pid, (cls, 0.0))[1], 0.0)
    return sums["ours"], sums["other"]


def delta(a: Snapshot, b: Snapshot) -> dict[str, float | None]:
    """Seconds of CPU between two snapshots, per part, and the machine's busy share."""

    def d(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else max(y - x, 0.0)

    busy = d(a.machine_busy, b.machine_busy)
    total = d(a.machine_total, b.machine_total)
    pg, pg_other = _pg_delta(a, b)
    out: dict[str, float | None] = {
        "wall": b.at - a.at,
        "consumer": d(a.self_cpu, b.self_cpu),
        "postgres": pg,
        "postgres_other_databases": pg_other,
        "broker": d(a.broker, b.broker),
        "machine_busy": busy,
        "machine_total": total,
    }
    parts = [out["consumer"], out["postgres"], out["broker"]]
    if busy is not None and all(p is not None for p in parts):
        out["other"] = max(busy - sum(p for p in parts if p is not None), 0.0)
    else:
        out["other"] = None
    return out


class Watch:
    """CPU between :meth:`start` and :meth:`stop`, polling PostgreSQL's processes every
    ``interval`` seconds so that backends which end before :meth:`stop` (pgbench's, a
    short-lived connection's) are counted up to their last poll. ``pid``: the consumer
    (default: this process)."""

    def __init__(self, pids: Pids, interval: float = 0.5, *, pid: int | None = None) -> None:
        self.pids = pids
        self.pid = pid
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[str, float]] = {}
        self.first: Snapshot | None = None
        self._threads: dict[int, tuple[str, float]] = {}  # this process's, at the start
        self._threads_seen: dict[int, tuple[str, float]] = {}
        self.threads: dict[str, float] = {}  # CPU seconds per kind of thread, at stop

    def start(self) -> Watch:
        self.first = snapshot(self.pids, self_pid=self.pid)
        self._seen = dict(self.first.postgres or {})
        self._threads = threads(self.pid)
        self._threads_seen = dict(self._threads)
        self._thread = threading.Thread(target=self._poll, name="bench-procstat", daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._seen.update(snapshot(self.pids, self_pid=self.pid).postgres or {})
            self._threads_seen.update(threads(self.pid))

    def stop(self) -> dict[str, float | None]:
        assert self.first is not None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        last = snapshot(self.pids, self_pid=self.pid)
        self._seen.update(last.postgres or {})
        merged = Snapshot(last.at, last.self_cpu, dict(self._seen) if last.postgres is not None
                          else None, last.broker, last.machine_busy, last.machine_total)
        out = delta(self.first, merged)
        self.threads = thread_delta(self._threads, self._threads_now())
        return out

    def _threads_now(self) -> dict[int, tuple[str, float]]:
        got = threads(self.pid)
        self._threads_seen.update(got)
        return dict(self._threads_seen)


def _group(name: str) -> str:
    """A thread's kind: its name without a trailing number (``kafka-idem-key-12`` ->
    ``kafka-idem-key``, librdkafka's ``rdk:broker3`` -> ``rdk:broker``)."""
    return name.rstrip("0123456789").rstrip("-_") or name


def threads(pid: int | None = None) -> dict[int, tuple[str, float]]:
    """This process's threads now: native id -> (kind, CPU seconds). Python threads by
    their ``threading`` name, the others (librdkafka's) by their kernel name."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    me = pid or os.getpid()
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            text = Path(f"/proc/{me}/task/{tid}/stat").read_text()
        except OSError:
            continue
        comm = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        out[int(tid)] = (_group(names.get(int(tid), comm)), _cpu(fields))
    return out


def thread_delta(a: dict[int, tuple[str, float]],
                 b: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per kind of thread between two :func:`threads` readings (a thread
    started in between counts whole; one that ended loses what it ran after the last
    reading that saw it)."""
    out: dict[str, float] = {}
    for tid, (kind, cpu) in b.items():
        before = a.get(tid, (kind, 0.0))[1]
        out[kind] = out.get(kind, 0.0) + max(cpu - before, 0.0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def rss_mb(pid: int | None = None) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB, from /proc/<pid>/status."""
    rss = hwm = 0.0
    try:
        for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, hwm


def database_of(dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    return str(conninfo_to_dict(dsn).get("dbname") or "postgres")


def cpu_count() -> int:
    return os.cpu_count() or 1
