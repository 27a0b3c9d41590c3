"""The trainers share one GPU. Every arm starts at once; an arm whose trainer runs out of GPU memory beside
the others starts again as soon as another finishes. On an 80 GB H100 four trainers of the 16,384-id
target took it all (30.7 GiB at the full vocabulary, about 16 GiB at 4,096 ids) and one died, while an
H200 holds six. Nothing is estimated: what fits runs at once, the rest follows."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

from .common import log

MARKS = ("torch.OutOfMemoryError", "CUDA out of memory")
TRIES = 3  # an arm out of memory this often is out of memory alone


class OutOfMemory(Exception):
    """An arm's trainer died of CUDA out-of-memory (its log says so)."""


def out_of_memory(log_path: Path) -> bool:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return any(m in text for m in MARKS)


def run_arms(procs: dict, finish, launch, started) -> None:
    """procs: arm -> (Popen, start time), launched. finish(arm, p, t0) -> arm, raising OutOfMemory;
    launch(arm) -> (Popen, start time); started(arm) is called in this (the main) thread as each arm's
    draft is ready. An arm out of memory waits for another to end, then starts again (alone if every
    running arm died)."""
    tries, waiting = dict.fromkeys(procs, 1), []
    with cf.ThreadPoolExecutor(max(1, len(procs))) as pool:
        running = {pool.submit(finish, arm, *pt): arm for arm, pt in procs.items()}
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            ended = 0
            for f in done:
                arm = running.pop(f)
                try:
                    started(f.result())
                    ended += 1
                except OutOfMemory:
                    if tries[arm] >= TRIES:
                        raise SystemExit(f"train {arm}: out of GPU memory {TRIES} times, the last beside "
                                         f"{len(running)} other trainers") from None  # fmt: skip
                    log(f"train {arm}: out of GPU memory beside {len(running)} other trainers; again once one ends")
                    waiting.append(arm)
            for _ in range(max(ended, 0 if running else 1)):  # as many as ended; one if none runs
                if waiting:
                    arm = waiting.pop(0)
                    tries[arm] += 1
                    running[pool.submit(finish, arm, *launch(arm))] = arm
