"""Step 4: SpecForge 0.2.0's own trainer trains every arm's draft at once, each exported for SGLang."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .common import NICE, OWN_READER, PACKAGE, ROOT, arms, log, seed_of
from .controls import control_sizes, permuted, wrong_norm
from .fp8slots import fp8_aux, fp8_final
from .vocab import OWN_MAPS, mappings
from .waves import OutOfMemory, out_of_memory, run_arms

if TYPE_CHECKING:
    from .serve import Serving


def draft_json(work: Path, layer_ids: list[int], draft_vocab: int = 0, name: str = "draft") -> Path:
    """SpecForge's Llama EAGLE-3 draft for this target (its configs/llama3-8B-eagle3.json, scaled):
    one decoder layer, the capture layer ids that the export printed, in SpecForge's convention; over
    the target's vocab (no d2t mapping needed) or `draft_vocab` ids (the mapping run_yaml names)."""
    t = json.loads((work / "target" / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id", "head_dim")  # fmt: skip
    cfg = {k: t[k] for k in keep if k in t}
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab or t["vocab_size"],
        target_hidden_size=t["hidden_size"],
        torch_dtype="bfloat16",
        eagle_config={"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    )
    p = work / "drafts" / f"{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cfg, indent=1))
    return p


def run_yaml(
    work: Path, arm: str, features: Path, draft: Path, layer_ids: list[int], plan: dict, vocab_map: str | None = None
) -> Path:
    """plan: epochs, batch_size, learning_rate, ttt_length, export_steps, samples (the same for every
    arm; the untrained one takes one step at a learning rate of ~0; the export arm, with export_steps
    set, stops after that many steps of the same schedule: its horizon is the full run's)."""
    from specforge.training.schedule import resolve_total_steps  # its own horizon, for the capped export arm

    untrained = arm == "untrained"
    horizon = resolve_total_steps(
        total_steps=None, max_steps=None, num_samples=plan["samples"], batch_size=plan["batch_size"],
        accumulation_steps=1, num_epochs=plan["epochs"],
    )  # fmt: skip
    cap = 1 if untrained else (plan["export_steps"] or None) if arm == "real_export" else None
    cfg = {
        "run_id": arm,
        "output_dir": str(work / "drafts" / arm),
        "model": {
            "target_model_path": str(work / "target"),
            "draft_model_config": str(draft),
            "aux_hidden_state_layer_ids": layer_ids,
            **({"vocab_mapping_path": vocab_map} if vocab_map else {}),
        },
        "data": {
            "hidden_states_path": str(features),
            "max_length": 2048,
            "cache_dir": str(work / "drafts" / f"cache-{arm}"),
            "dataloader_num_workers": 2,
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": 1 if untrained else plan["epochs"],
            "max_steps": cap,
            "total_steps": None if untrained else horizon,
            "batch_size": plan["batch_size"],
            "learning_rate": 1e-12 if untrained else plan["learning_rate"],
            "ttt_length": plan["ttt_length"],
            "attention_backend": "sdpa",
            "fsdp_sharding": "NO_SHARD",  # one GPU: their DDP path (FSDP also refuses a CPU plumbing check)
            "log_interval": 10,
            "seed": seed_of(arm),
        },
    }
    p = work / "drafts" / f"{arm}.json"  # JSON is YAML: SpecForge's load_config reads it
    p.write_text(json.dumps(cfg, indent=1))
    return p


def sf_train(arm: str, config: str, *export: str) -> int:
    """One `specforge train -c CONFIG`, in this process (run as a subprocess of `train`); then, given
    `export` (the arguments of `specforge export`), the draft exported for SGLang in the same process:
    a second process would spend its first 20 s importing. If that export fails, finish_arm runs it
    as a command of its own."""
    from specforge.cli import main

    from recipe.shards.export import specforge_raw
    from recipe.shards.trainers import specforge_reads_shards

    kind = arm.split("_seed")[0]  # a second seed of an arm (bench/draft_peer.py) reads as the arm does
    if kind in OWN_READER:
        code = main(["train", "-c", config])  # its own reader over .ckpt files (our export's or its own)
    else:
        items = {"permuted": permuted, "wrong_norm": wrong_norm, "fp8_final": fp8_final, "fp8_aux": fp8_aux}
        with specforge_reads_shards(items.get(kind, specforge_raw)):
            code = main(["train", "-c", config])
    if code == 0 and export:
        try:
            print(f"specforge export in the training process: exit {main(['export', *export])}", flush=True)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - finish_arm exports again, in a process of its own
            print(f"specforge export in the training process failed: {type(e).__name__}: {e}", flush=True)
    return code


def sglang_export_args(work: Path, arm: str, draft: Path) -> list[str]:
    return ["--to", "sglang", "--checkpoint", str(work / "drafts" / arm), "--draft-config", str(draft),
            "--output-dir", str(work / "serve" / arm)]  # fmt: skip


def specforge(*args: str, log_path: Path) -> subprocess.Popen:
    code = "import sys; from specforge.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def loss_curve(log_path: Path) -> list[dict]:
    """SpecForge's console logger prints `step N: {metrics}` every log_interval steps."""
    import ast

    curve = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("step ") and ": {" in line:
            step, metrics = line[5:].split(": ", 1)
            try:
                curve.append({"step": int(step), **ast.literal_eval(metrics)})
            except (ValueError, SyntaxError):
                continue
    return curve


def served_arms(plan: dict) -> tuple[str, ...]:
    """The export arm is served only when it trains the whole run (export_steps 0); otherwise its
    curve is compared with the direct arm's over the steps it ran."""
    return tuple(arm for arm in arms(plan) if arm != "real_export" or not plan["export_steps"])


def arm_inputs(work: Path, plan: dict, layer_ids: list[int]) -> dict[str, dict]:
    """Each arm's shards, draft config and vocabulary mapping (with --draft-vocab: the set's own mapping
    for every arm but full_vocab, which predicts over the whole vocabulary, other_data and shuffled,
    whose mappings come from other text and from the set's counts on shuffled ids, and --regen's
    original arms, which get the original set's own)."""
    shards, n = work / "shards", plan.get("draft_vocab") or 0
    vocab = mappings(work, n, bool(plan.get("regen"))) if n else None
    reduced, full = draft_json(work, layer_ids, n), draft_json(work, layer_ids, 0, "draft-full")
    out = {}
    for arm in arms(plan):
        kind = arm.split("_seed")[0]
        features = {"real_export": work / "sf-export", **{k: shards / k for k in ("off_by_one", "fp8", "original")}}
        mapping = None if not vocab or kind == "full_vocab" else vocab[kind if kind in OWN_MAPS else "real"]
        out[arm] = {"features": features.get(kind, shards / "real"), "draft": full if kind == "full_vocab" else reduced,
                    "vocab_map": mapping["path"] if mapping else None}  # fmt: skip
    return {"arms": out, "vocab": vocab}


def train_drafts(work: Path, plan: dict, serving: Serving) -> dict:
    """Every arm at once on the one GPU (tiny drafts leave it mostly idle; an arm out of memory beside the
    others trains again once one ends: waves.py). The export to SpecForge's
    files (spread over processes) runs while the arms that read the shards start; its arm starts when
    it is done, with the layer ids it printed checked equal to the ones the other arms' draft config
    took from the same function. Each arm's draft is exported for SGLang as soon as it finishes, and
    its server started (Serving); the target alone's server starts now. The shard sets are verified
    (`python -m recipe.shards verify`) meanwhile."""
    from recipe.shards.export import draft_config
    from recipe.shards.reader import ShardReader

    shards = work / "shards"
    reader = ShardReader(shards / "real")
    layer_ids = draft_config(reader, "specforge")["eagle_aux_hidden_state_layer_ids"]
    plan = dict(plan, samples=len(reader))
    inputs = arm_inputs(work, plan, layer_ids)
    todo = [arm for arm in arms(plan) if not (work / "drafts" / f"{arm}-curve.json").exists()]
    need_sets(inputs["arms"], todo)
    launch = functools.partial(launch_arm, work, inputs=inputs["arms"], layer_ids=layer_ids, plan=plan)
    procs = {arm: launch(arm) for arm in todo if arm != "real_export"}
    sets = [d.name for d in sorted(shards.iterdir()) if (d / "manifest.json").exists()]
    verifies = {name: verify(shards / name, work / "drafts" / f"verify-{name}.log") for name in sets}
    serving.start("target")
    for arm in arms(plan):
        if arm not in todo:  # a resumed call: trained and exported already
            serving.start(arm)
    info = {"layer_ids_specforge": layer_ids, "plan": plan, "vocab": inputs["vocab"]}
    if "real_export" in arms(plan):
        info.update(export_for_specforge(work, layer_ids))
    if "real_export" in todo:
        procs["real_export"] = launch("real_export")
    info.update(control_sizes(work))

    def finish(arm: str, p: subprocess.Popen, t0: float) -> str:
        return finish_arm(work, arm, p, t0, inputs["arms"][arm]["draft"], serving.arms)

    run_arms(procs, finish, launch, serving.start)  # each draft's server started in the main thread (Serving.start)
    for name, v in verifies.items():
        if v.wait() != 0:
            raise SystemExit(f"verify {name} failed: see {work / 'drafts' / f'verify-{name}.log'}")
    info["verified"] = sorted(verifies)
    info["arms"] = {}
    for arm in arms(plan):
        curve = json.loads((work / "drafts" / f"{arm}-curve.json").read_text())
        info["arms"][arm] = {"log_points": len(curve), "first": curve[0] if curve else None,
                             "last": curve[-1] if curve else None}  # fmt: skip
    if "real_export" in arms(plan):
        info["direct_vs_export"] = compare_curves(work)
    return info


def export_for_specforge(work: Path, layer_ids: list[int]) -> dict:
    """`python -m recipe.shards export --to specforge` of the real set (once), its printed layer ids
    checked against the drafts' config."""
    export_dir, t0 = work / "sf-export", time.monotonic()
    if not (export_dir / "export_info.json").exists():
        subprocess.run(
            [*NICE, sys.executable, "-m", "recipe.shards", "export", "--to", "specforge", str(work / "shards" / "real"),
             str(export_dir), "--overwrite", "--workers", "8"], cwd=ROOT, check=True,
        )  # fmt: skip
    printed = json.loads((export_dir / "export_info.json").read_text())["draft_config"]
    if printed["eagle_aux_hidden_state_layer_ids"] != layer_ids:
        raise SystemExit(f"export printed layer ids {printed} but the drafts were configured with {layer_ids}")
    return {"export_seconds": round(time.monotonic() - t0, 1)}


def need_sets(inputs: dict, todo: list[str]) -> None:
    """Each arm to train has its shards: a resumed call may name an arm whose set the first one skipped."""
    missing = sorted({str(x["features"]) for arm, x in inputs.items() if arm in todo and arm != "real_export"
                      and not (x["features"] / "manifest.json").exists()})  # fmt: skip
    if missing:
        raise SystemExit(f"no shards at {', '.join(missing)}: run `bench/draft extract` with this call's options first")


def verify(shards: Path, log_path: Path) -> subprocess.Popen:
    argv = [*NICE, sys.executable, "-m", "recipe.shards", "verify", str(shards)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def launch_arm(work: Path, arm: str, inputs: dict, layer_ids: list[int], plan: dict, serve=None):
    """`inputs`: each arm's features, draft and vocab_map (arm_inputs). `serve`: export the draft for
    SGLang when it is trained (default: the arm is in served_arms)."""
    x = inputs[arm]
    cfg = run_yaml(work, arm, x["features"], x["draft"], layer_ids, plan, x["vocab_map"])
    for earlier in (work / "serve" / arm, work / "drafts" / arm):  # an earlier call's or try's export, checkpoints
        shutil.rmtree(earlier, ignore_errors=True)
    logf = open(work / "drafts" / f"{arm}.log", "w")
    # six trainers, the export's workers and servers share 16 cores: torch's default of a thread per
    # core in each would oversubscribe them (GPU math is unaffected by CPU threads). The arms that end
    # long before the rest (one step; the export's first steps, compared step by step, which priority
    # does not change) run at nice 19, so the arms the scenario waits for get the cores
    env = dict(os.environ, DRAFT_TARGET=str(work / "target"), OMP_NUM_THREADS="2")
    serve = arm in served_arms(plan) if serve is None else serve
    beside = arm == "untrained" or (arm == "real_export" and not serve)
    argv = [*(NICE if beside else ()), sys.executable, str(PACKAGE), *sftrain_argv(work, arm, cfg, x["draft"], serve)]
    log(f"train {arm}: SpecForge on {x['features']}" + (f", vocabulary {x['vocab_map']}" if x["vocab_map"] else ""))
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT), time.monotonic()


def sftrain_argv(work: Path, arm: str, cfg: Path, draft: Path, export: bool) -> list[str]:
    """This script's arguments for one arm's training process (`main` hands them to `sf_train`)."""
    return ["_sftrain", arm, str(cfg), *(sglang_export_args(work, arm, draft) if export else ())]


def finish_arm(work: Path, arm: str, p: subprocess.Popen, t0: float, draft: Path, served: tuple) -> str:
    """Wait for one arm's training (and its draft's export for SGLang, if it is served: the export is
    run here if the training process's failed), keep its loss curve (written last: it marks the arm
    done for a resumed call)."""
    if p.wait() != 0:
        if out_of_memory(work / "drafts" / f"{arm}.log"):
            raise OutOfMemory(arm)
        tail = "\n".join((work / "drafts" / f"{arm}.log").read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"train {arm}: specforge train exited {p.returncode}\n{tail}")
    took = time.monotonic() - t0
    if arm in served and not (work / "serve" / arm / "config.json").exists():
        ex = specforge("export", *sglang_export_args(work, arm, draft), log_path=work / "drafts" / f"{arm}-export.log")
        if ex.wait() != 0:
            raise SystemExit(f"export {arm}: see {work / 'drafts' / f'{arm}-export.log'}")
    curve = loss_curve(work / "drafts" / f"{arm}.log")
    (work / "drafts" / f"{arm}-curve.json").write_text(json.dumps(curve))
    log(f"train {arm}: {took:.0f} s, {len(curve)} log points; ready to serve {time.monotonic() - t0:.0f} s")
    return arm


def compare_curves(work: Path) -> dict:
    """The direct and the export arm's training metrics at every step both logged (the export arm may
    stop early); timings (`perf/*`) left out."""
    a, b = (json.loads((work / "drafts" / f"{x}-curve.json").read_text()) for x in ("real", "real_export"))
    n = min(len(a), len(b))
    worst, compared = 0.0, 0
    for x, y in zip(a[:n], b[:n]):
        for k, v in x.items():
            if k != "step" and not k.startswith("perf/") and isinstance(v, float) and isinstance(y.get(k), float):
                worst = max(worst, abs(v - y[k]) / max(abs(y[k]), 1e-9))
                compared += 1
    return {"points": n, "values_compared": compared, "steps": [x["step"] for x in b[:n]],
            "same_steps": n > 0 and [x["step"] for x in a[:n]] == [y["step"] for y in b[:n]],
            "max_relative_difference": worst}  # fmt: skip
