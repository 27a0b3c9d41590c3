"""Step 3: extraction, exactly as a user runs it (`python -m recipe backend=sglang ...`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, eagle3_layers, log


def recipe_argv(work: Path, name: str, layers: list[int], port: int) -> list[str]:
    return [
        sys.executable, "-m", "recipe", "backend=sglang", "model=tiny-llama", f"model.name={name}",
        f"model.path={work / 'target'}", "data=jsonl", f"data.sources=[{work / 'data' / 'train.jsonl'}]",
        "data.max_length=2048", f"capture.layers=[{','.join(map(str, layers))}]",
        f"output_dir={work / 'shards' / name}", f"capture.dump_dir=/dev/shm/hs-draft-{name}",
        f"server.port={port}", "server.args.attention_backend=triton", "server.args.mem_fraction_static=0.3",
        "+server.args.max_total_tokens=262144",
        f"hydra.run.dir={work / 'runs' / name}",
    ]  # fmt: skip


def capture_runs(work: Path) -> dict[str, list[int]]:
    """The layers each extraction captures, from the depth of the target on disk (so a resumed call
    captures what that target's draft config will claim): the default, and one layer deeper."""
    layers = eagle3_layers(json.loads((work / "target" / "config.json").read_text())["num_hidden_layers"])
    return {"real": layers, "off_by_one": [i + 1 for i in layers]}


def extract(work: Path) -> dict:
    """The real shards at the default layers and the off-by-one control's one layer deeper, both runs
    at once: each server's KV cache is capped (max_total_tokens), so neither one's start-up memory
    check sees the other's cache as taken. Both sets are verified while the drafts train."""
    runs = capture_runs(work)
    info, procs = {}, {}
    for i, (name, layers) in enumerate(runs.items()):
        if (work / "shards" / name / "manifest.json").exists():
            continue
        argv = recipe_argv(work, name, layers, 31100 + 10 * i)
        log("extract:", " ".join(argv[1:]))
        procs[name] = (subprocess.Popen(argv, cwd=ROOT), time.monotonic())
    for name, (p, t0) in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"extract {name}: python -m recipe failed (log in {work / 'runs' / name})")
        info[name] = {"seconds_with_server_start": round(time.monotonic() - t0, 1)}
    for name in runs:
        m = json.loads((work / "shards" / name / "manifest.json").read_text())
        info.setdefault(name, {}).update(layers=m["capture"]["layers"], counts=m.get("counts"))
    return info
