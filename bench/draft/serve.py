"""Step 5: SGLang's EAGLE3 serves each draft: acceptance length, and decode speed beside the target alone."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from .common import BATCH1_PROMPTS, SERVE, SPEC, STOP_GRACE_S, arms
from .data import eval_prompts
from .servers import decode_figures, eagle3_server, server
from .train import served_arms


class Serving:
    """The serving step's servers, each started as soon as what it serves exists: the target alone when
    the drafts start training, each draft as soon as its arm is exported for SGLang. A start is mostly
    imports (about 50 s on the GPU host), so it overlaps the training. Each control's acceptance length
    is measured as soon as its server is ready, beside whatever else runs (a count of accepted tokens,
    not a timing), and that server is stopped. Decode speed (`serve`) waits for the GPU to itself."""

    def __init__(self, work: Path, plan: dict):
        self.work, self.arms = work, served_arms(plan)
        self.ports = {"target": 32000, **{arm: 32010 + i for i, arm in enumerate(arms(plan))}}
        self.servers, self.started, self.ready_s, self.acceptance, self.errors = {}, {}, {}, {}, {}
        self.threads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in self.servers.values():
            s.stop(grace_s=STOP_GRACE_S)

    def start(self, name: str) -> None:
        """`name`: "target" (the target alone) or a served arm; started once. Call it from the main
        thread: a server dies with the thread that started it (its parent-death signal)."""
        if name in self.servers or (name != "target" and name not in self.arms):
            return
        w, port = self.work, self.ports[name]
        if name == "target":
            s = server(w, "serve-target", w / "target", port)
        else:
            s = eagle3_server(w, f"serve-{name}", w / "serve" / name, port)
        self.servers[name] = s
        s.start()
        self.started[name] = time.monotonic()
        control = name not in ("target", "real")
        if control:  # read here, once: transformers' lazy imports are not thread-safe (two controls' threads
            eval_prompts(w)  # importing AutoTokenizer at once failed one with an ImportError on the H100)
        t = threading.Thread(target=self._acceptance if control else self._note_ready, args=(name,), daemon=True)
        t.start()
        self.threads.append(t)

    def wait_ready(self, name: str):
        s = self.servers[name]
        s.wait_ready()
        self.ready_s.setdefault(name, round(time.monotonic() - self.started[name], 1))
        return s

    def _note_ready(self, name: str) -> None:
        """Only when it came up (its start-up time); `serve` measures it later."""
        try:
            self.wait_ready(name)
        except Exception as e:  # noqa: BLE001 - reported by controls(), in the main thread
            self.errors[name] = f"{type(e).__name__}: {str(e)[-2000:]}"

    def _acceptance(self, arm: str) -> None:
        try:
            s = self.wait_ready(arm)
            self.acceptance[arm] = decode_figures(s, eval_prompts(self.work), stop_ids(self.work), 16)
        except Exception as e:  # noqa: BLE001 - reported by controls(), in the main thread
            self.errors[arm] = f"{type(e).__name__}: {str(e)[-2000:]}"
        finally:
            self.servers[arm].stop(grace_s=STOP_GRACE_S)

    def controls(self) -> dict:
        """Every control's acceptance figures, once all are measured and their servers stopped (a server
        shutting down takes CPU that a launch-bound decode needs). Starts what a resumed call lacks."""
        for name in ("target", *self.arms):
            self.start(name)
        for t in self.threads:
            t.join()
        if self.errors:
            raise SystemExit(f"serving failed: {self.errors}")
        return dict(self.acceptance)


def stop_ids(work: Path) -> list[int]:
    return [json.loads((work / "target" / "config.json").read_text())["eos_token_id"]]


def serve(work: Path, serving: Serving) -> dict:
    """Each control draft's acceptance length (batch 16, every held-out prompt; measured as each server
    came up, see Serving), then, with the GPU to itself, decode speed at batch 16 and batch 1 for the
    real draft (its batch-16 run gives its acceptance length) and for the target alone."""
    prompts, stop = eval_prompts(work), stop_ids(work)
    info = {"prompts": len(prompts), "batch_1_prompts": BATCH1_PROMPTS, "flags": SERVE + SPEC}
    info.update(acceptance=serving.controls(), speed={})
    for name, key in (("real", "real_draft"), ("target", "target_alone")):
        s = serving.wait_ready(name)
        info["speed"][key] = {
            f"batch_{b}": decode_figures(s, prompts[: BATCH1_PROMPTS if b == 1 else None], stop, b) for b in (16, 1)
        }
        s.stop(grace_s=STOP_GRACE_S)
    info["server_ready_seconds"] = dict(serving.ready_s)
    info["acceptance"]["real"] = info["speed"]["real_draft"]["batch_16"]
    for b in ("batch_1", "batch_16"):
        t, d = info["speed"]["target_alone"][b], info["speed"]["real_draft"][b]
        d["speedup"] = round(d["tokens_per_s"] / t["tokens_per_s"], 3)
        d["same_outputs_as_target"] = d["outputs_sha1"] == t["outputs_sha1"]
    return info
