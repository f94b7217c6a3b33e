"""Child processes die with the CLI, even when the CLI is SIGKILLed: a small watchdog process (the "reaper").

Processes the CLI starts (the local Ray's gcs_server / raylet / agents and, through the raylet, every worker) are not
killed by the kernel when their parent dies: they are re-parented and linger. A SIGKILL runs no handler and no
``finally``, so the cleanup has to live in another process:

    CLI --stdin pipe--> reaper (own session, so Ctrl-C to the CLI's group does not reach it)
    CLI exits cleanly:  writes "q" and closes the pipe  -> the reaper exits and kills nothing
    CLI dies any way:   the kernel closes the pipe (EOF)  -> the reaper SIGKILLs the watched pids and all their
                                                              descendants (found in /proc), then exits

Before killing, each pid's start time (from /proc/<pid>/stat) is compared with the one recorded when it was handed
over, so a pid the kernel reused for an unrelated process is left alone. Linux only (needs /proc); elsewhere
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
import os, signal, sys

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19]
    except OSError:
        return None

def children_map():
    result = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            result.setdefault(ppid, []).append(int(entry))
    return result

watched = {}
for item in sys.argv[1:]:
    pid, started = item.split(":", 1)
    watched[int(pid)] = started.encode()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
data = sys.stdin.buffer.read()
if data.startswith(b"q"):
    sys.exit(0)
roots = [pid for pid, started in watched.items() if start_time(pid) == started]
kids = children_map()
targets, stack = [], list(roots)
while stack:
    pid = stack.pop()
    if pid in targets or pid == os.getpid():
        continue
    targets.append(pid)
    stack.extend(kids.get(pid, ()))
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in targets:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    if sig == signal.SIGTERM:
        import time
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
