"""One-off probe: serve tiny-kimi-k2.5 at TP=1 and look at one request's dump (dtype, finiteness per slot)."""

import json
import os
import sys
import time

import httpx
import numpy as np
import torch

sys.argv = [sys.argv[0]]
os.environ.setdefault("GPU_WORK", "/tmp/gpu-probe")
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/gpu")
import test_gpu_sglang as T  # noqa: E402

from recipe.capture import records  # noqa: E402

res = {}
with T.Running("kimi", 33100, "+server.args.enforce_disable_flashinfer_allreduce_fusion=true", tp=2) as srv:
    for name, ids in (
        ("bytes", list(range(1, 100))),
        ("specials", list(range(1, 50)) + list(range(256, 267)) * 3),
        ("high", list(range(130, 256))),
    ):
        rid = f"hsx-probe-{name}"
        r = httpx.post(
            srv.url + "/generate",
            json={
                "input_ids": ids,
                "rid": rid,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            },
            timeout=60,
        ).json()
        time.sleep(2)
        out = {"logprobs_finite": bool(np.isfinite([x[0] for x in r["meta_info"]["input_token_logprobs"][1:]]).all())}
        for p in sorted(srv.dump.glob(f"{rid}.*.hsr")):
            h, i, hid = records.read_record(p)
            x = torch.from_numpy(hid.astype(np.int16)).view(torch.bfloat16).float()
            out.setdefault("records", []).append(
                {
                    "n": h["n"],
                    "finite_per_slot": torch.isfinite(x).float().mean(dim=(0, 2)).tolist(),
                    "first_nonfinite_row": int((~torch.isfinite(x)).any(2).any(1).float().argmax()),
                }
            )
        res[name] = out
        print(name, json.dumps(out), flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/probe.json", "w"), indent=1, default=str)
