"""The run's folder on the RAM disk, owned through an flock held for the run's life.

Runs share /dev/shm across containers (`ipc: host`) and PID namespaces, where a PID says nothing
(every container's recipe is PID 1). An flock does: the kernel drops it when its holder dies, however
it died, so a folder whose lock can be taken belongs to no live run and is removed; one whose lock
is held is never touched. The folder is created under a temporary name with the lock already held,
then renamed, so no other run ever sees it unlocked.

The folders are private: each user's runs live under `<dump_dir>/user-<uid>` (0700), since they hold
the hidden states of whatever data a run extracts. The shared parent, when the recipe creates it, is
world-writable and sticky like /tmp, so a root run (a container with `ipc: host`) never locks a later
user out of it. Only this user's own folder is ever scanned for abandoned runs.
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

from ..errors import UserError

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


class DumpDirError(UserError, RuntimeError):
    pass


def user_root(parent: str | Path) -> Path:
    """`parent`/user-<uid>, private to this user (created if needed)."""
    parent = Path(parent)
    if not parent.exists():
        parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):  # another user made it meanwhile
            os.chmod(parent, 0o1777)
    root = parent / f"user-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
    except PermissionError:
        raise DumpDirError(
            f"capture.dump_dir={parent}: this user cannot create a folder there (owned by uid "
            f"{parent.stat().st_uid}, mode {parent.stat().st_mode & 0o7777:o}); `chmod 1777 {parent}` "
            "as its owner, or set capture.dump_dir to a folder of yours on the RAM disk"
        ) from None
    st = root.stat()
    if st.st_uid != os.getuid():
        raise DumpDirError(
            f"{root} belongs to uid {st.st_uid}, not to this user: remove it or pick another capture.dump_dir"
        )
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


@contextlib.contextmanager
def dump_dir(parent: str | Path):
    """A fresh folder for this run, private to its user, locked while the block runs, removed after it."""
    root = user_root(parent)
    remove_abandoned(root)
    name = f"run-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    tmp = root / f".new-{name}"
    tmp.mkdir(mode=0o700)
    fd = os.open(tmp / OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    d = root / name
    os.rename(tmp, d)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        os.close(fd)
