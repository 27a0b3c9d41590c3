"""Step 3: extraction, exactly as a user runs it (`python -m recipe backend=sglang ...`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .common import REPLY_BYTES, ROOT, eagle3_layers, log


def recipe_argv(work: Path, name: str, layers: list[int], port: int, extra: tuple = ()) -> list[str]:
    return [
        sys.executable, "-m", "recipe", "backend=sglang", "model=tiny-llama", f"model.name={name}",
        f"model.path={work / 'target'}", "data=jsonl", f"data.sources=[{work / 'data' / 'train.jsonl'}]",
        "data.max_length=2048", f"capture.layers=[{','.join(map(str, layers))}]",
        f"output_dir={work / 'shards' / name}", f"capture.dump_dir=/dev/shm/hs-draft-{name}",
        f"server.port={port}", "server.args.attention_backend=triton", "server.args.mem_fraction_static=0.3",
        "+server.args.max_total_tokens=262144",
        f"hydra.run.dir={work / 'runs' / name}", *extra,
    ]  # fmt: skip


FP8 = ("shards.codec=fp8",)
# --regen: the target rewrites each conversation's answer through the same server, greedy as the measure
# decodes, then the capture prefills what it wrote (the recipe's data.regenerate)
REGEN = ("data.regenerate.turns=last", "data.regenerate.temperature=0",
         f"data.regenerate.max_new_tokens={REPLY_BYTES + 64}")  # fmt: skip


def capture_runs(
    work: Path, fp8: bool = False, regen: bool = False, arms: tuple = ("off_by_one",)
) -> dict[str, tuple[list[int], tuple]]:
    """The layers (and extra overrides) each extraction captures, from the depth of the target on disk (so a
    resumed call captures what that target's draft config will claim): the default, one layer deeper
    where the call trains the off_by_one arm (`arms`: the call's), and (fp8) the default again stored
    in the fp8 codec. With `regen`: the target's own answers (real) and the original ones, at the
    default layers."""
    layers = eagle3_layers(json.loads((work / "target" / "config.json").read_text())["num_hidden_layers"])
    if regen:
        return {"real": (layers, REGEN), "original": (layers, ())}
    runs = {"real": (layers, ())} | ({"off_by_one": ([i + 1 for i in layers], ())} if "off_by_one" in arms else {})
    return runs | ({"fp8": (layers, FP8)} if fp8 else {})


def extract(work: Path, fp8: bool = False, regen: bool = False, arms: tuple = ("off_by_one",)) -> dict:
    """The real shards at the default layers and, where the call trains that arm, the off-by-one
    control's one layer deeper (and, given fp8, the default layers in the fp8 codec); a set already
    captured is kept. All runs at once: each server's KV cache is capped
    (max_total_tokens), so no one's start-up memory check sees another's cache as taken. The sets are
    verified while the drafts train."""
    runs = capture_runs(work, fp8, regen, arms)
    info, procs = {}, {}
    for i, (name, (layers, extra)) in enumerate(runs.items()):
        if (work / "shards" / name / "manifest.json").exists():
            continue
        argv = recipe_argv(work, name, layers, 31100 + 10 * i, extra)
        log("extract:", " ".join(argv[1:]))
        procs[name] = (subprocess.Popen(argv, cwd=ROOT), time.monotonic())
    for name, (p, t0) in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"extract {name}: python -m recipe failed (log in {work / 'runs' / name})")
        info[name] = {"seconds_with_server_start": round(time.monotonic() - t0, 1)}
    for name in runs:
        m = json.loads((work / "shards" / name / "manifest.json").read_text())
        t = m["totals"]
        info.setdefault(name, {}).update(
            layers=m["capture"]["layers"],
            counts=m.get("counts"),
            stored_over_raw=round(t["stored_bytes"] / t["raw_bytes"], 4),
        )
    return info
