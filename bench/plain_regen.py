"""What a user without the recipe runs to train on the target's own answers: plain generation, then plain
prefill of what was generated, on one plain SGLang server (the dump off, decode CUDA graphs on, as a
regenerating run has them). bench/product.py --regenerate times it against the recipe's data.regenerate.

Each sample's prompt is generated to the length the recipe's run generated for it (ignore_eos), with
data.regenerate's sampling and concurrency; then prompt + generated ids are prefilled by the recipe's
client at its concurrency. Timed: the first generation request to the last prefill response."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import prefill

from recipe.data import Sample

DECODE_GRAPHS = ("server.args.cuda_graph_backend_decode=null",)  # SGLang's default: on


def generate(url: str, sid: str, prompt: list[int], n: int, regen) -> list[int]:
    sampling = {"max_new_tokens": n, "temperature": float(regen.temperature), "top_p": float(regen.top_p),
                "ignore_eos": True, "sampling_seed": 0}  # fmt: skip
    body = {"input_ids": prompt, "rid": f"plain-gen-{sid}", "sampling_params": sampling}
    r = httpx.post(url + "/generate", json=body, timeout=3600)
    r.raise_for_status()
    return [int(i) for i in r.json()["output_ids"]][:n]


def arm(args, model_dir: Path, rows: list[tuple[str, list[int], int]]) -> dict:
    """rows: (sample id, prompt ids, generated length) per sample."""
    dump_parent = Path(args.shm) / "bench-plain-regen"
    dump_parent.mkdir(parents=True, exist_ok=True)
    stats = Path(args.work) / "hook-stats-plain-regen.json"
    be, cfg = prefill.arm_backend(args, "plain", model_dir, dump_parent, stats, extra=DECODE_GRAPHS)
    regen = cfg.data.regenerate
    try:
        be.server.start()
        ready = be.server.wait_ready()
        be.opts.launch = False
        t0 = time.monotonic()
        with ThreadPoolExecutor(regen.concurrency) as pool:
            outs = list(pool.map(lambda r: generate(be.url, *r, regen), rows))
        t_gen = time.monotonic() - t0
        samples = [Sample(id=sid, input_ids=np.asarray(p + o, np.int32), loss_mask=np.ones(len(p) + len(o), np.uint8),
                          source="bench", key=sid) for (sid, p, _), o in zip(rows, outs)]  # fmt: skip
        be.run(samples, prefill.NullPacker())
        t_all = time.monotonic() - t0
    finally:
        be.server.stop()
        shutil.rmtree(dump_parent, ignore_errors=True)
    lengths = [len(o) for o in outs]
    return {"arm": "plain-regen", "server_ready_s": round(ready, 1), "samples": len(rows),
            "generated_tokens": sum(lengths), "same_lengths": lengths == [r[2] for r in rows],
            "generate_s": round(t_gen, 3), "prefill_s": round(t_all - t_gen, 3),
            "client_s": round(t_all, 3)}  # fmt: skip
