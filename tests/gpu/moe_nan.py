"""Which Qwen3-MoE shapes SGLang 0.5.16 serves with NaN final states: one factor at a time, on one GPU.

    python tests/gpu/moe_nan.py --out moe_nan.json        # resumable: an arm already in the report is skipped

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
import subprocess
import sys
import time
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
          "server.args.mem_fraction_static=0.3", "data.limit=8", "capture.layers=[1,2,3]"]  # fmt: skip


def hf_finite(model_dir: Path) -> bool:
    import torch

    from recipe.backends.hf import load_causal_lm

    m = load_causal_lm(model_dir, torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 256, (1, 64), device="cuda")
    with torch.inference_mode():
        hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    return all(bool(torch.isfinite(h).all()) for h in hs)


def arm(name: str, shape: dict, work: Path) -> dict:
    from recipe.models import common, qwen3_moe

    model = work / name / "model"
    if not (model / "config.json").exists():
        common.build(qwen3_moe, model, **shape)
    t0 = time.time()
    argv = [sys.executable, "-m", "recipe", *SGLANG, f"model.path={model}", f"output_dir={work / name / 'out'}",
            f"hydra.run.dir={work / name / 'run'}"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=work)
    log = r.stdout + r.stderr
    return {"shape": {**qwen3_moe.SHAPE, **shape}, "exit": r.returncode, "seconds": round(time.time() - t0, 1),
            "non_finite": "NaN or infinite" in log, "hf_finite": hf_finite(model),
            "reason": [x for x in log.splitlines() if "ERROR" in x][-3:], "log_tail": log[-1500:]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_nan.json")
    ap.add_argument("--work", default="/tmp/moe-nan")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    report = json.loads(out.read_text()) if out.exists() else {}
    for name, shape in ARMS.items():
        if name in report:
            continue
        report[name] = arm(name, shape, work)
        print(name, {k: report[name][k] for k in ("exit", "non_finite", "hf_finite", "seconds")}, flush=True)
        out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
