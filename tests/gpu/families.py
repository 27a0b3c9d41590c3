"""Every built-in family through the patched SGLang on one GPU, as a user runs it, against HF.

    python tests/gpu/families.py --out report.json [--only tiny-gpt-oss,...] [--parallel 6]
    python tests/gpu/families.py --backend hf --device cpu --only tiny-llama    # the plumbing, on a CPU

Per family, in a folder of its own: `python -m recipe backend=sglang model.path=builtin:tiny-<family>`
(its in-run self-check compares the final slot through lm_head with SGLang's own prompt logprobs and
refuses the run if they disagree), then `python -m recipe.shards verify`. Then, for each stored sample:
each slot against HF on the same safetensors, within 2x bf16's own distance from float32 and nearest
its configured index; token ids and loss masks equal to the plan the template gives. Servers start a
few at a time (each with a small share of the GPU's memory). The report keeps every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LAYERS = [1, 2, 3]
SAMPLES = 12
EXTRA = {  # what a family needs beyond the common flags (triton attention: the slim kernel wheel has no fa3)
    "tiny-kimi-k2.5": ["model.trust_remote_code=true"],
    # Marlin, INT4's default runner, compiles with nvcc for over 6 min on first use: triton's runner here.
    "tiny-kimi-k2.5-int4": ["model.trust_remote_code=true", "+server.args.moe_runner_backend=triton"],
}


SGLANG = ["backend=sglang", "client.self_check=4", "server.args.attention_backend=triton",
          "server.args.mem_fraction_static=0.12", "server.args.chunked_prefill_size=256"]  # fmt: skip
# transformers' loader sets the process's default dtype while it builds a model: two loads at once in
# threads give a model parameters of the other's dtype. Extractions run side by side, comparisons one
# at a time.
COMPARING = threading.Lock()
# SGLang sizes its KV pool from free memory measured before and after its load: a neighbour starting
# in between looks like its own weights. Such a start is tried once more.
CROWDED = "leave no GPU memory for the KV cache"


def extract(name: str, work: Path, port: int, backend: str) -> dict:
    out, t0 = work / name, time.time()
    server = [*SGLANG, f"server.port={port}"] if backend == "sglang" else ["backend=hf", "backend.device=cpu"]
    argv = [sys.executable, "-m", "recipe", *server, f"model.path=builtin:{name}", f"output_dir={out}",
            f"capture.layers={LAYERS}", f"data.limit={SAMPLES}", f"hydra.run.dir={work / 'runs' / name}",
            *EXTRA.get(name, [])]  # fmt: skip
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=work)
    except subprocess.TimeoutExpired as e:
        return {"exit": "timeout", "seconds": round(time.time() - t0, 1), "log_tail": str(e.stderr or "")[-1500:]}
    log = (r.stdout + r.stderr)[-4000:]
    v = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(out)], capture_output=True, text=True)
    return {"exit": r.returncode, "seconds": round(time.time() - t0, 1), "verify_exit": v.returncode,
            "self_check": [x for x in log.splitlines() if "self-check" in x][-5:], "log_tail": log[-1500:]}  # fmt: skip


def rel_l2(a, b) -> list[float]:
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2))).tolist()


def compare(name: str, work: Path, device: str) -> dict:
    """Stored slots against HF (bf16 and float32) on the same checkpoint; ids and masks against the plan."""
    import numpy as np
    import torch

    from recipe.backends.hf import HFBackend, load_causal_lm
    from recipe.models import materialize
    from recipe.shards import ShardReader

    model_dir, r = materialize(name), ShardReader(work / name)
    bf16, fp32 = (HFBackend(model_dir, LAYERS, True, device=device, dtype=d) for d in ("bfloat16", "float32"))
    whole = load_causal_lm(model_dir, torch.bfloat16).to(device).eval()
    worst, bound, nearest = [0.0] * 4, [0.0] * 4, []
    for sid in r.ids:
        x = r.get(sid)
        ids = x["input_ids"].numpy()
        ref, ref32 = bf16.hidden_states([ids])[0], fp32.hidden_states([ids])[0]
        worst = [max(a, b) for a, b in zip(worst, rel_l2(x["hidden"], ref))]
        bound = [max(a, 2 * b) for a, b in zip(bound, rel_l2(ref, ref32))]
        with torch.inference_mode():
            hs = whole(
                input_ids=torch.as_tensor(ids, device=device).long()[None], output_hidden_states=True
            ).hidden_states
        depth = len(hs) - 1
        nearest.append([int(np.argmin([rel_l2(x["hidden"][:, k : k + 1], h[0, :, None].cpu())[0] for h in hs]))
                        for k in range(len(LAYERS) + 1)])  # fmt: skip
    want = LAYERS + [depth]
    return {"samples": len(r.ids), "rel_l2_worst": worst, "bound_2x_bf16": bound, "nearest_index": nearest,
            "nearest_ok": all(n == want for n in nearest), "within_bound": all(w <= b for w, b in zip(worst, bound)),
            "plan_equal": plan_equal(name, r)}  # fmt: skip


def plan_equal(name: str, r) -> bool:
    """Stored token ids and loss masks are the ones the template gives for the same records."""
    import numpy as np
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from recipe import schema
    from recipe.data import build_plan
    from recipe.main import CONF_DIR
    from recipe.models import materialize

    schema.register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["output_dir=/o", f"data.limit={SAMPLES}"]).data
    tok = AutoTokenizer.from_pretrained(materialize(name), trust_remote_code="kimi" in name)
    plan = {s.id: s for s in build_plan(cfg, tok).samples}
    return all(np.array_equal(r.get(i)["input_ids"].numpy(), plan[i].input_ids)
               and np.array_equal(r.get(i)["loss_mask"].numpy(), plan[i].loss_mask) for i in r.ids)  # fmt: skip


def family(name: str, port: int, a: argparse.Namespace) -> dict:
    res = extract(name, Path(a.work), port, a.backend)
    if res["exit"] != 0 and CROWDED in res.get("log_tail", ""):
        time.sleep(20)
        res = extract(name, Path(a.work), port, a.backend) | {"retried": True}
    if res["exit"] == 0 and res["verify_exit"] == 0:
        try:
            with COMPARING:
                res.update(compare(name, Path(a.work), a.device))
        except Exception as e:  # one family's failure is a finding; the others still report
            res["compare_error"] = repr(e)[-2000:]
    res["ok"] = bool(res["exit"] == 0 and res.get("nearest_ok") and res.get("within_bound") and res.get("plan_equal"))
    return res


def main() -> int:
    import transformers  # noqa: F401  (its lazy imports, resolved here, not raced by the threads)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from recipe.models import BUILTIN

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="families.json")
    ap.add_argument("--work", default="/tmp/families")
    ap.add_argument("--only", default="")
    ap.add_argument("--parallel", type=int, default=7)
    ap.add_argument("--backend", default="sglang", choices=["sglang", "hf"])
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    names = [n for n in BUILTIN if n != "tiny-llama-256" and (not a.only or n in a.only.split(","))]
    Path(a.work).mkdir(parents=True, exist_ok=True)
    report = {"backend": a.backend, "gpu": os.environ.get("GPU_NAME", ""), "families": {}}
    with ThreadPoolExecutor(a.parallel) as pool:  # each family's report is written as it finishes
        jobs = {pool.submit(family, n, 31000 + i, a): n for i, n in enumerate(names)}
        for job in as_completed(jobs):
            res = report["families"][jobs[job]] = job.result()
            brief = {k: res.get(k) for k in ("exit", "seconds", "rel_l2_worst")}
            print(jobs[job], "OK" if res["ok"] else "FAILED", brief)
            Path(a.out).write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
