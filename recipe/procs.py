"""Child processes that die with the recipe, however it dies (kill -9 included)."""

from __future__ import annotations

import ctypes
import os
import signal

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int):
    """A function to run in the child (Popen's preexec_fn, or first thing in a worker): the kernel
    SIGKILLs the child when its parent dies. Only a syscall: the parent may have threads running."""

    def arm():
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return arm
