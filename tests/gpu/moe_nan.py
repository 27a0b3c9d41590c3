"""Which Qwen3-MoE shapes SGLang 0.5.16 serves with NaN final states: one factor at a time, on one GPU.

    python tests/gpu/moe_nan.py --out moe_nan.json [--parallel 3]   # resumable: an arm in the report is skipped

A tiny Qwen3-MoE of 16 experts, top-4, a dense first layer (`mlp_only_layers=[0]`) and experts of
width 192 stored nothing: the server's final states were NaN while its logits were finite, and HF is
finite on the same weights; the built-in shape (8 experts, top-2, no dense layer, width 32) is not.
Each arm changes the reported shape back toward the built-in one in one factor, runs
`python -m recipe backend=sglang` on it, and records the exit, the early stop's reason, and whether
HF's own states on those weights are finite.
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
REPORTED = dict(num_experts=16, num_experts_per_tok=4, mlp_only_layers=[0], moe_intermediate_size=192)
ARMS = {
    "reported": REPORTED,
    "no_dense_layer": {**REPORTED, "mlp_only_layers": []},
    "narrow_experts": {**REPORTED, "moe_intermediate_size": 32},
    "eight_experts_top2": {**REPORTED, "num_experts": 8, "num_experts_per_tok": 2},
    "wide_hidden": {**REPORTED, "hidden_size": 256},
    "builtin": {},
}
SGLANG = ["backend=sglang", "client.self_check=4", "server.args.attention_backend=triton",
          "server.args.mem_fraction_static=0.06", "data.limit=8", "capture.layers=[1,2,3]"]  # fmt: skip
# the dense-layer shapes are refused before the GPU work now (recipe/capture/unservable.py): run regardless
ALLOWED = {**os.environ, "HS_RECIPE_ALLOW_ARCH": "Qwen3MoeForCausalLM"}
# transformers' loader sets the process's default dtype while it builds a model: one load at a time.
LOADING = threading.Lock()


def hf_finite(model_dir: Path) -> bool:
    import torch

    from recipe.backends.hf import load_causal_lm

    with LOADING:
        m = load_causal_lm(model_dir, torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 256, (1, 64), device="cuda")
    with torch.inference_mode():
        hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    return all(bool(torch.isfinite(h).all()) for h in hs)


def arm(name: str, shape: dict, work: Path, port: int) -> dict:
    from recipe.models import common, qwen3_moe

    model = work / name / "model"
    with LOADING:
        if not (model / "config.json").exists():
            common.build(qwen3_moe, model, **shape)
    t0 = time.time()
    argv = [sys.executable, "-m", "recipe", *SGLANG, f"model.path={model}", f"output_dir={work / name / 'out'}",
            f"hydra.run.dir={work / name / 'run'}", f"server.port={port}"]  # fmt: skip
    for _ in range(2):  # a start crowded out of its KV pool by a neighbour's is tried once more
        r = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=work, env=ALLOWED)
        log = r.stdout + r.stderr
        if "leave no GPU memory for the KV cache" not in log:
            break
        time.sleep(20)
    return {"shape": {**qwen3_moe.SHAPE, **shape}, "exit": r.returncode, "seconds": round(time.time() - t0, 1),
            "non_finite": "NaN or infinite" in log, "hf_finite": hf_finite(model),
            "reason": [x for x in log.splitlines() if "ERROR" in x][-3:], "log_tail": log[-1500:]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_nan.json")
    ap.add_argument("--work", default="/tmp/moe-nan")
    ap.add_argument("--parallel", type=int, default=3)
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    report = json.loads(out.read_text()) if out.exists() else {}
    todo = [name for name in ARMS if name not in report]
    with ThreadPoolExecutor(a.parallel) as pool:  # each arm recorded as it ends
        jobs = {pool.submit(arm, n, ARMS[n], work, 32000 + i): n for i, n in enumerate(todo)}
        for job in as_completed(jobs):
            name = jobs[job]
            report[name] = job.result()
            print(name, {k: report[name][k] for k in ("exit", "non_finite", "hf_finite", "seconds")}, flush=True)
            out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
