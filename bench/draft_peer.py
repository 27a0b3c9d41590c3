"""A draft from SpecForge's own extraction beside drafts from the recipe's shards: the same conversations,
target and training schedule, served the same way. Does either set train a draft that SGLang accepts as
often? Run after `bench/draft all`, in its work folder, on the same machine:

    python bench/draft_peer.py --work /tmp/draft --out draft-peer.json    # bash tests/gpu/device.sh draft-peer

Steps:
  extract  SpecForge 0.2.0's scripts/prepare_hidden_states.py as its docs run it (torchrun, one process,
           batch 32, its in-process SGLang 0.5.14 staged by tests/gpu/stage-peer.sh) on bench/draft's training
           conversations (as its `conversations`; each has bench/draft's system turn, so its llama3 template
           adds no system prompt of its own), at the draft config's layers. Its files are checked
           against our shards on the first --check conversations (bench/peers.py's same-data check:
           token ids, loss masks, and each state's distance)
  train    SpecForge trains drafts from its files (its own reader) with seeds 0..K-1 and from our shards
           with seeds 1..K-1 (--seeds K; seed 0 is bench/draft's real draft), all at once, on bench/draft's
           schedule. A seed sets the draft's initialisation and the order the sampler draws samples in
  serve    every draft in an SGLang EAGLE3 server: acceptance length at batch 16 on the held-out prompts
Verdict: the two sets train drafts that accept alike (within noise) when the difference of their mean
acceptance lengths is within twice its standard error, from the spread of the seeds about their set's
mean (pooled: with K seeds a side, 2K - 2 degrees of freedom).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import draft  # noqa: E402
import peers  # noqa: E402

SETS = {"ours": "real", "specforge": "specforge_set"}  # each set's arm at seed 0; seed s > 0: ARM_seed{s}


def seed_arms(seeds: int) -> dict[str, list[str]]:
    """Each set's arms, seed 0 first; ours at seed 0 is bench/draft's real draft, trained already."""
    return {k: [arm] + [f"{arm}_seed{s}" for s in range(1, seeds)] for k, arm in SETS.items()}


def write_specforge_data(work: Path) -> Path:
    """bench/draft's training conversations as SpecForge reads them: {"conversations": [system, user,
    assistant]}."""
    out = work / "data" / "train-specforge.jsonl"
    with open(work / "data" / "train.jsonl") as f, open(out, "w") as fo:
        for line in f:
            fo.write(json.dumps({"conversations": json.loads(line)["messages"]}) + "\n")
    return out


def specforge_extract(work: Path, data: Path, script: str, peer_site: str) -> dict:
    out = work / "sf-peer"
    for d in (out, work / "sf-peer-cache"):  # it skips samples whose files exist, and caches its dataset
        shutil.rmtree(d, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script]
    cmd += ["--target-model-path", str(work / "target"), "--data-path", str(data), "--output-path", str(out)]
    cmd += ["--chat-template", "llama3", "--max-length", "2048", "--tp-size", "1"]
    cmd += ["--batch-size", "32", "--draft-model-config", str(work / "drafts" / "draft.json")]
    cmd += ["--sglang-attention-backend", "triton", "--cache-dir", str(work / "sf-peer-cache")]
    env = dict(os.environ, PYTHONPATH=f"{peer_site}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.monotonic()
    with open(work / "drafts" / "specforge-extract.log", "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"SpecForge's extraction exited {rc}: see {work / 'drafts' / 'specforge-extract.log'}")
    files = sorted(out.rglob("data_*.ckpt"))
    size = sum(p.stat().st_size for p in files)
    return {"command": " ".join(cmd), "seconds": round(time.monotonic() - t0, 1), "files": len(files), "bytes": size}


def train_peers(work: Path, plan: dict, layer_ids: list[int], sf_files: int, seeds: int) -> dict:
    """Every arm but bench/draft's real one, at once, each exported for SGLang as it finishes
    (draft.launch_arm / finish_arm)."""
    draft_cfg, sets = work / "drafts" / "draft.json", seed_arms(seeds)
    arms_plans = {}
    for s, arm in enumerate(sets["specforge"]):
        arms_plans[arm] = (work / "sf-peer", dict(plan, samples=sf_files, seed=s))
    for s, arm in enumerate(sets["ours"][1:], start=1):
        arms_plans[arm] = (work / "shards" / "real", dict(plan, seed=s))
    inputs = {arm: {"features": f, "draft": draft_cfg, "vocab_map": None} for arm, (f, _) in arms_plans.items()}
    procs = {arm: draft.launch_arm(work, arm, inputs, layer_ids, p, serve=True) for arm, (_, p) in arms_plans.items()}
    with cf.ThreadPoolExecutor(len(procs)) as pool:
        done = [
            pool.submit(draft.finish_arm, work, arm, p, t, draft_cfg, tuple(procs)) for arm, (p, t) in procs.items()
        ]
        for f in done:
            f.result()
    arms = {}
    for arm in procs:
        curve = json.loads((work / "drafts" / f"{arm}-curve.json").read_text())
        arms[arm] = {"log_points": len(curve), "last": curve[-1] if curve else None}
    return arms


def acceptance(work: Path, names: tuple[str, ...]) -> dict:
    """Each draft in its own EAGLE3 server (started here, in the main thread: a server dies with the
    thread that started it), all at once; batch 16 on the held-out prompts."""
    prompts, stop = draft.eval_prompts(work), draft.stop_ids(work)
    servers = {}
    for i, name in enumerate(names):
        servers[name] = draft.eagle3_server(work, f"peer-serve-{name}", work / "serve" / name, 32100 + i)
    try:
        for s in servers.values():
            s.start()

        def measure(s):
            s.wait_ready()
            return draft.decode_figures(s, prompts, stop, 16)

        with cf.ThreadPoolExecutor(len(servers)) as pool:
            done = {n: pool.submit(measure, s) for n, s in servers.items()}
            return {n: f.result() for n, f in done.items()}
    finally:
        for s in servers.values():
            s.stop(grace_s=draft.STOP_GRACE_S)


def verdict(acc: dict, seeds: int) -> dict:
    """SpecForge's set against ours: the difference of the mean acceptance lengths, and its standard
    error from the seeds' spread about their set's mean (pooled over both sets)."""
    sets = {k: [acc[arm]["accept_length"] for arm in arms] for k, arms in seed_arms(seeds).items()}
    means = {k: statistics.fmean(v) for k, v in sets.items()}
    dof = sum(len(v) for v in sets.values()) - len(sets)
    pooled = sum((x - means[k]) ** 2 for k, v in sets.items() for x in v) / dof
    se = math.sqrt(pooled * sum(1 / len(v) for v in sets.values()))
    diff = means["specforge"] - means["ours"]
    return {"accept_length": sets, "mean": {k: round(m, 3) for k, m in means.items()},
            "specforge_minus_ours": round(diff, 3), "standard_error": round(se, 3), "degrees_of_freedom": dof,
            "within_noise": abs(diff) <= 2 * se}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/draft"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--peer-site", default="/tmp/peer", help="SGLang 0.5.14 and its pins (tests/gpu/stage-peer.sh)")
    ap.add_argument("--specforge-script", default=".gpu-wheels/p2/prepare_hidden_states.py")
    ap.add_argument("--check", type=int, default=64, help="conversations whose SpecForge files are checked")
    ap.add_argument("--seeds", type=int, default=3, help="drafts per set (ours at seed 0 is bench/draft's)")
    a = ap.parse_args(argv)
    if a.seeds < 2:
        ap.error("--seeds: at least 2 drafts per set, or there is no spread to measure the noise by")
    res = json.loads((a.work / "results.json").read_text())  # bench/draft's: its plan and its layer ids
    if not (a.work / "serve" / "real" / "config.json").exists():
        raise SystemExit(f"no served real draft in {a.work}: run bench/draft all there first")
    t0 = time.monotonic()
    for d in ("sf-export", "shards/off_by_one"):  # the disk holds our shards and SpecForge's files, not more
        shutil.rmtree(a.work / d, ignore_errors=True)
    data = write_specforge_data(a.work)
    out = {"extract": specforge_extract(a.work, data, str(Path(a.specforge_script).resolve()), a.peer_site)}
    draft.log(f"peer: SpecForge wrote {out['extract']['files']} files in {out['extract']['seconds']} s")
    out["same_data"] = peers.compare(a.work / "shards" / "real", a.work / "sf-peer", a.work / "data" / "train.jsonl",
                                     limit=a.check)  # fmt: skip
    plan, layer_ids = res["train"]["plan"], res["train"]["layer_ids_specforge"]
    out["train"] = train_peers(a.work, plan, layer_ids, out["extract"]["files"], a.seeds)
    out["acceptance"] = acceptance(a.work, tuple(arm for arms in seed_arms(a.seeds).values() for arm in arms))
    out["verdict"] = verdict(out["acceptance"], a.seeds)
    out["call_seconds"] = round(time.monotonic() - t0, 1)
    draft.report(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
