"""Ends the Ray processes a sweep started once the sweep's process is gone, however it ended.

``ray.init()`` on one machine starts its head processes (GCS, raylet, agents, workers) as
descendants of the driver; killed with SIGKILL, the driver cannot stop them, and some of them
ignore SIGTERM. :func:`start_reaper` launches this module as a separate process in its own
session: every half second it records the driver's descendants (from ``/proc``), and when the
driver no longer exists it sends SIGKILL to those still alive whose command line names Ray, then
exits. Linux only (elsewhere it does nothing).

Run as ``python -m stage_dse.runner.reaper DRIVER_PID``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["descendants", "start_reaper"]

POLL_S = 0.5


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree (Linux ``/proc``)."""
    kids = _children_map()
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in kids.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def _is_ray(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").lower()
    except OSError:
        return False
    return b"ray" in cmd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is gone for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def watch(driver: int) -> None:
    seen: set[int] = set()
    while _alive(driver):
        seen |= {p for p in descendants(driver) if p != os.getpid()}
        time.sleep(POLL_S)
    for pid in seen:
        if _alive(pid) and _is_ray(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def start_reaper(driver: int | None = None) -> subprocess.Popen | None:
    """Start the watcher for ``driver`` (default: this process); None where ``/proc`` is
    missing."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "stage_dse.runner.reaper", str(driver or os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
