"""Every failure path ends the process: `python -m recipe` with a failure put into each stage of the
packer (a worker's bug, a worker's full disk, a commit that fails, the packer thread's own bug)
exits non-zero in bounded time (the committer and the worker processes stopped with it: a thread
or a child left waiting would keep it alive), and the same command then resumes to a whole set."""

import subprocess
import sys
import time

import pytest

from recipe.shards import ShardReader
from recipe.shards.verify import verify

DRIVER = """
import errno, sys
import recipe.packer.scheduler as scheduler
import recipe.packer.worker as worker
import recipe.shards.store as store

point = sys.argv[1]
real_pack, real_commit, real_index = worker.pack, store.ShardStore.commit, scheduler.index
calls = {"n": 0}

def third(fn, exc):  # the first two samples go through, then `exc`
    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] > 2:
            raise exc
        return fn(*a, **k)
    return wrapped

if point == "worker_bug":
    worker.pack = third(real_pack, ZeroDivisionError("a bug in the worker"))
elif point == "worker_disk_full":
    worker.pack = third(real_pack, OSError(errno.ENOSPC, "No space left on device"))
elif point == "commit_fails":
    store.ShardStore.commit = third(real_commit, OSError(errno.EIO, "Input/output error"))
elif point == "packer_thread_bug":
    scheduler.index = third(real_index, KeyError("a bug in the packer thread"))
sys.argv = ["recipe", *sys.argv[2:]]
import recipe.__main__
"""

EXPECT = {  # what the user sees: a bug keeps its traceback, a full disk is one line
    "worker_bug": "ZeroDivisionError: a bug in the worker",
    "worker_disk_full": "output disk full",
    "commit_fails": "Input/output error",
    "packer_thread_bug": "KeyError: 'a bug in the packer thread'",
}


@pytest.mark.parametrize("point", list(EXPECT))
def test_a_failure_in_any_packer_stage_ends_the_process(tmp_path, point):
    out = tmp_path / "out"
    args = [f"output_dir={out}", f"capture.dump_dir={tmp_path / 'shm'}", "data.limit=12", "shards.workers=2"]
    args += ["shards.commit_every=1", "log_every_s=1000"]
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, point, *args], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stderr[-2000:]
    assert EXPECT[point] in r.stderr, r.stderr[-2000:]
    assert took < 120, f"the process took {took:.0f} s to end"
    # nothing lost: the same command, without the failure, resumes and the set verifies
    again = subprocess.run([sys.executable, "-m", "recipe", *args], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(ShardReader(out)) == 12 and verify(out) == []
