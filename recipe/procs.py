"""Process lifetimes: child processes that die with the recipe, however it dies (kill -9 included),
the recipe's own exit, and work spread over spawned processes."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int):
    """A function to run in the child (Popen's preexec_fn, or first thing in a worker): the kernel
    SIGKILLs the child when its parent dies. Only a syscall: the parent may have threads running.
    "Parent" is the thread that started the child: a child started from a thread that ends (a pool's
    worker) is killed then, so start long-lived children from the main thread."""

    def arm():
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return arm


def exit_without_teardown(code) -> None:
    """Exit now with sys.exit's status for `code`. By the time `python -m recipe`'s main returns, every
    sample is durable and the run has reported; what is left is the interpreter unloading its
    modules, torch's among them: a second or more that a user would wait out after every run.
    Non-daemon threads and the exit handlers (logging's flush, multiprocessing's joins) still run."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # what a normal exit runs before the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def in_order(fn, tasks: list[tuple], workers: int, setup, setup_args: tuple, here):
    """fn(*task) for every task, results in task order, as each is ready: over up to `workers` spawned
    processes, each prepared once by setup(*setup_args), or (one worker, one task) in this process,
    with `here` as fn's last argument. Spawn, not fork: the caller may hold torch, threads and mapped
    files, which a fork would copy."""
    if workers > 1 and len(tasks) > 1:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(tasks)), ctx, setup, setup_args) as pool:
            yield pool.map(fn, *zip(*tasks))
    else:
        yield (fn(*task, here) for task in tasks)
