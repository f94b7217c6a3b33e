"""Child processes die with the CLI, even when the CLI is SIGKILLed: a small watchdog process (the "reaper").

Processes the CLI starts (the local Ray's gcs_server / raylet / agents and, through the raylet, every worker) are not
killed by the kernel when their parent dies: they are re-parented and linger. A SIGKILL runs no handler and no
``finally``, so the cleanup has to live in another process:

    CLI --stdin pipe--> reaper (own session, so Ctrl-C to the CLI's group does not reach it)
    CLI exits cleanly:  writes "q" and closes the pipe  -> the reaper exits and kills nothing
    CLI dies any way:   the kernel closes the pipe (EOF)  -> the reaper SIGTERMs, then SIGKILLs, the watched pids and
                                                              all their descendants, then exits

Descendants are collected from /proc every second while waiting, not only at the end: Ray's own daemons die with the
CLI too (prctl death signal), so by the time the pipe closes the raylet may be gone and its agents already re-parented
to init, invisible to a last-moment walk (seen: DashboardAgent and RuntimeEnvAgent lingering). Every pid is kept with
its start time (field 22 of /proc/<pid>/stat) and only signalled while that still matches, so a pid the kernel reused
for an unrelated process is left alone. Linux only (needs /proc); elsewhere
``start_reaper`` returns None.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

_REAPER_CODE = r"""
import os, select, signal, sys, time

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

def children_map():
    result = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                result.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
            except (OSError, ValueError, IndexError):
                continue
    return result

def refresh(known):
    kids = children_map()
    stack = [pid for pid in known]
    while stack:
        for child, started in kids.get(stack.pop(), ()):
            if child not in known and child != os.getpid():
                known[child] = started
                stack.append(child)

known = {}
for item in sys.argv[1:]:
    pid, started = item.split(":", 1)
    known[int(pid)] = started.encode()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
data = b""
while True:
    ready, _, _ = select.select([sys.stdin.buffer], [], [], 1.0)
    if ready:
        data = os.read(sys.stdin.fileno(), 1)
        break
    refresh(known)
if data.startswith(b"q"):
    sys.exit(0)
refresh(known)
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid, started in known.items():
        if start_time(pid) == started:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    if sig == signal.SIGTERM:
        time.sleep(0.5)
"""


class Reaper:
    """The running watchdog; ``dismiss()`` on a clean exit (after the children were stopped normally)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def dismiss(self) -> None:
        try:
            self.process.stdin.write(b"q")
            self.process.stdin.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.process.kill()


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw.rsplit(b")", 1)[1].split()[19].decode()


def live_start_time(pid: int) -> str | None:
    """Like ``process_start_time``, but None for a zombie too (a process that exited and was not reaped yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def live_descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pid`` (from /proc); compare start times later to tell a
    process still running from a reused pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            started = live_start_time(child)
            if started is not None:
                found[child] = started
                stack.append(child)
    return found


def start_reaper(pids: Iterable[int]) -> Reaper | None:
    """Watch ``pids`` (and their descendants at the time the CLI dies); None where /proc is missing."""
    if not Path("/proc/self/stat").exists():
        return None
    args = []
    for pid in sorted(set(pids)):
        started = process_start_time(pid)
        if started is not None:
            args.append(f"{pid}:{started}")
    process = subprocess.Popen(
        [sys.executable, "-c", _REAPER_CODE, *args],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    return Reaper(process)


def local_ray_pids() -> list[int]:
    """Pids of the processes ``ray.init`` started here (gcs_server, raylet, dashboard, monitors); [] if none."""
    try:
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        if node is None:
            return []
        return [info.process.pid for infos in node.all_processes.values() for info in infos
                if getattr(info, "process", None) is not None]
    except Exception:  # noqa: BLE001 - a Ray internal that moved: no reaper rather than no server
        logger.warning("cannot list the local Ray's processes; they may outlive a killed prefixserve", exc_info=True)
        return []
