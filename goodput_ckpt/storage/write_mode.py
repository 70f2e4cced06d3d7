"""Whether a local save the caller waits for writes its data files around the page cache.

Measured with ``benchmarks/bench_physical.py`` (docs/benchmarks.md, "The physical limit"), a save
against a raw ``write`` + ``fsync`` of the same bytes, both ways in the same run:

- with CPUs to spare, buffered writes win: the page cache takes the bytes at memory speed and
  its writeback (started early by ``sync_file_range``) merges them, while direct writes wait on
  the device request by request (0.96x raw buffered against 0.74x direct, 256 MiB);
- when runnable tasks wait for the CPUs, direct writes win: a buffered save needs more CPU than
  raw (the page-cache copy and page allocation, plus hashing) and gets a fraction of it, while a
  direct save needs one ``memmove`` per chunk (0.48x raw buffered against 1.39x direct under 4
  busy loops and a page-cache filler on 2 CPUs). Since buffered writes to a file are copied one
  at a time (:mod:`.local_sink`), a buffered save of 256 MiB takes 0.12-0.14 CPU-s against 0.24-0.29
  before and raw's 0.07, and the gap narrowed, but direct still won in 8 of the 10 contended runs
  of session 20 (buffered 0.59-2.24x raw, direct 0.57-4.42x in the same runs; buffered won the
  two at the lowest load, 9-13 on 2 CPUs).

Neither way alone stays at 0.9x raw in both, so with ``LocalConfig.direct_writes=None`` a save
reads the machine's state when it opens a data file and writes direct when the CPUs are
contended or memory is being reclaimed. The signals are the kernel's pressure-stall figures
(PSI, Linux 4.20+): the share of the last 10 seconds in which some task waited for a CPU, or
stalled on memory reclaim, in this process's cgroup (a container's own figures) or, where it
has none, the whole machine's. Without PSI (another platform, a kernel built without it) the
1-minute load average against the CPUs this process may run on stands in for CPU pressure.
Reading them costs two small reads of ``/proc`` or ``/sys`` per data file.
"""

from __future__ import annotations

import os

__all__ = [
    "CPU_PRESSURE_LIMIT",
    "LOAD_PER_CPU_LIMIT",
    "MEMORY_PRESSURE_LIMIT",
    "decide",
    "pressure",
    "should_write_direct",
    "signals",
]

#: Percent of the last 10 s in which some runnable task waited for a CPU, from which a save writes
#: direct. Measured on 2 vCPUs: 9 before the quiet run where buffered saves kept up with raw
#: writes (0.96x), 88-99 in every run where they fell to 0.25-0.7x raw and direct ones did better
#: (docs/benchmarks.md, "The physical limit"); the line is between them.
CPU_PRESSURE_LIMIT = 50.0
#: Percent of the last 10 s in which some task stalled on memory reclaim, from which a save writes
#: direct: each page-cache page a buffered write takes must then first be reclaimed.
MEMORY_PRESSURE_LIMIT = 10.0
#: Runnable tasks per usable CPU (1-minute load average), without PSI, from which a save writes
#: direct: more runnable tasks than CPUs is the state that CPU pressure measures (the quiet run
#: had 0.4-0.7 per CPU, the contended ones 3-12; the average lags by a minute, hence the margin).
LOAD_PER_CPU_LIMIT = 1.5


def _cgroup_dir() -> str | None:
    """This process's cgroup v2 directory, or ``None`` (cgroup v1 only). In a container with its
    own cgroup namespace the group reads as ``/``: ``/sys/fs/cgroup`` is then the container's
    own group, whose figures count its tasks only (where that directory has no pressure files,
    on a host's root group or a v1/v2 hybrid, :func:`pressure` reads /proc/pressure)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii", errors="replace") as f:
            for line in f.read(4096).splitlines():
                if line.startswith("0::/"):
                    path = "/sys/fs/cgroup" + line[3:].rstrip("/")
                    return path if os.path.isdir(path) else None
    except OSError:
        pass
    return None


def _some_avg10(path: str) -> float | None:
    """The ``some avg10`` figure of a PSI file (``some avg10=1.23 avg60=... total=...``)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(512)
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                key, _, value = field.partition("=")
                if key == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def pressure(resource: str) -> float | None:
    """Percent of the last 10 s in which some task of this process's cgroup (else of the machine)
    waited for ``resource`` (``"cpu"``, ``"memory"``, ``"io"``), or ``None`` without PSI."""
    group = _cgroup_dir()
    if group is not None:
        value = _some_avg10(os.path.join(group, f"{resource}.pressure"))
        if value is not None:
            return value
    return _some_avg10(f"/proc/pressure/{resource}")


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - a platform without affinity
        return max(1, os.cpu_count() or 1)


def decide(cpu: float | None, memory: float | None, load_per_cpu: float | None) -> tuple[bool, str]:
    """Whether to write direct given the CPU and memory pressure (percent, ``None``: no PSI) and
    the 1-minute load average per usable CPU (used only without CPU pressure), and why."""
    if cpu is not None and cpu >= CPU_PRESSURE_LIMIT:
        return True, f"cpu pressure {cpu:.0f}% >= {CPU_PRESSURE_LIMIT:.0f}%"
    if memory is not None and memory >= MEMORY_PRESSURE_LIMIT:
        return True, f"memory pressure {memory:.0f}% >= {MEMORY_PRESSURE_LIMIT:.0f}%"
    if cpu is None and load_per_cpu is not None and load_per_cpu >= LOAD_PER_CPU_LIMIT:
        return True, f"load {load_per_cpu:.1f} per cpu >= {LOAD_PER_CPU_LIMIT} (no pressure figures)"
    return False, f"cpu pressure {cpu}, memory pressure {memory}, load {load_per_cpu} per cpu: room to spare"


def signals() -> tuple[float | None, float | None, float | None]:
    """This moment's CPU pressure, memory pressure and load average per usable CPU (see
    :func:`decide`); the load average is read only where there is no CPU pressure figure."""
    cpu, memory = pressure("cpu"), pressure("memory")
    load: float | None = None
    if cpu is None:
        try:
            load = os.getloadavg()[0] / _usable_cpus()
        except (AttributeError, OSError):  # pragma: no cover - a platform without a load average
            load = None
    return cpu, memory, load


def should_write_direct() -> tuple[bool, str]:
    """Whether a save the caller waits for should write around the page cache now, and why
    (a phrase for logs and benchmarks)."""
    return decide(*signals())
