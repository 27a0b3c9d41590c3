"""The run's folder on the RAM disk, owned through an flock held for the run's life.

Runs share /dev/shm across containers (`ipc: host`) and PID namespaces, where a PID says nothing
(every container's recipe is PID 1). An flock does: the kernel drops it when its holder dies, however
it died, so a folder whose lock can be taken belongs to no live run and is removed; one whose lock
is held is never touched. The folder is created under a temporary name with the lock already held,
then renamed, so no other run ever sees it unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)
OWNER = ".owner"


def remove_abandoned(root: Path) -> list[Path]:
    """Remove every run-* folder whose owner lock is free (its run is gone). Returns them."""
    removed = []
    for d in sorted([*root.glob("run-*"), *root.glob(".new-run-*")]):
        try:
            fd = os.open(d / OWNER, os.O_RDWR)
        except FileNotFoundError:  # a folder from before owner locks, or half removed: no live owner
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live run holds it
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            if fd is not None:
                os.close(fd)
    if removed:
        log.warning("removed %d abandoned dump folder(s) of killed runs in %s", len(removed), root)
    return removed


@contextlib.contextmanager
def dump_dir(parent: str | Path):
    """A fresh folder for this run, locked while the block runs, removed after it."""
    root = Path(parent)
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root)
    name = f"run-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    tmp = root / f".new-{name}"
    tmp.mkdir()
    fd = os.open(tmp / OWNER, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    d = root / name
    os.rename(tmp, d)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        os.close(fd)
