"""The steps in order (`all`), or one of them; each skips what the work folder already holds."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import DATA_SERVE, TARGET, arms, log
from .data import make_data, original_data
from .extract import capture_runs, extract
from .serve import Serving, serve
from .servers import server
from .target import train_target
from .train import sf_train, train_drafts


def goals(res: dict, ran_now: set[str]) -> dict:
    """`ran_now`: the steps this invocation ran; the scenario's time counts only when it ran them all."""
    acc = {arm: f.get("accept_length", 0.0) for arm, f in res["serve"]["acceptance"].items()}
    real = acc["real"]
    whole = ran_now >= {"target", "data", "extract", "train", "serve"}
    seconds = res["call_seconds"]  # the whole invocation: the steps overlap (Serving)
    return {
        "scenario_seconds": seconds if whole else None,
        "fits_one_10_minute_call": seconds <= 600 if whole else None,
        "accept_length_real_ge_2.5": real >= 2.5,
        **{f"{c}_le_0.8x_real": acc[c] <= 0.8 * real for c in ("permuted", "wrong_norm") if c in acc},
        "accept_length": acc,
        "relative_to_real": {arm: round(a / real, 3) if real else None for arm, a in acc.items()},
        **vocab_goals(acc),
        **seed_figures(acc),
    }


def vocab_goals(acc: dict) -> dict:
    """With a reduced draft vocabulary: it against the full-vocabulary draft, and each control mapping's
    draft (other data, shuffled counts) against it."""
    if "full_vocab" not in acc:
        return {}
    full = acc["full_vocab"]
    out = {"reduced_over_full": round(acc["real"] / full, 3), "reduced_ge_0.95x_full": acc["real"] >= 0.95 * full}
    for c in ("other_data", "shuffled"):
        if c in acc:
            out.update({f"{c}_over_full": round(acc[c] / full, 3), f"{c}_le_0.85x_full": acc[c] <= 0.85 * full})
    return out


def seed_figures(acc: dict) -> dict:
    """Each set's seeds (real: the lossless shards; fp8; fp8_final and fp8_aux: the lossless shards with
    those slots alone in fp8), their mean and standard error, and whether each set's mean and the real
    one lie within two standard errors of their difference."""
    import statistics

    kinds = ("real", "fp8", "fp8_final", "fp8_aux", "original")
    sets = {k: [a for arm, a in sorted(acc.items()) if arm.split("_seed")[0] == k] for k in kinds}
    if len(sets["real"]) < 2:
        return {}
    out = {}
    for k, xs in sets.items():
        if len(xs) >= 2:
            out[k] = {"seeds": xs, "mean": round(statistics.mean(xs), 4),
                      "se": round(statistics.stdev(xs) / len(xs) ** 0.5, 4)}  # fmt: skip
    pairs = [(k, f"{k}_minus_lossless") for k in ("fp8", "fp8_final", "fp8_aux")]
    for other, name in (*pairs, ("original", "original_minus_regenerated")):
        if other in out:
            diff = out[other]["mean"] - out["real"]["mean"]
            se = (out[other]["se"] ** 2 + out["real"]["se"] ** 2) ** 0.5
            out[name] = {"diff": round(diff, 4), "se": round(se, 4), "within_2_se": abs(diff) <= 2 * se}
    if "original" in out:
        out["regenerated_over_original"] = round(out["real"]["mean"] / out["original"]["mean"], 4)
    return {"seeds": out}


def unfinished(work: Path, name: str, plan: dict) -> bool:
    """A recorded step with work left for this call's arms (a resumed call may name arms the first one
    did not): a set to capture, a draft to train. A step that runs makes every later one run again."""
    if name == "extract":
        runs = capture_runs(work, plan["fp8"], plan["regen"], arms(plan))
        return any(not (work / "shards" / n / "manifest.json").exists() for n in runs)
    if name == "train":
        return any(not (work / "drafts" / f"{arm}-curve.json").exists() for arm in arms(plan))
    return False


# What makes the target and its data, and what makes the drafts: a work folder holds one of each, and a
# resumed call with other values would compare arms of two scenarios as if they were one
TARGET_OPTIONS = ("bpe_vocab", "regen", "norm_spread", "target_layers", "target_seconds", "train_conversations",
                  "eval_prompts", "data_temperature")  # fmt: skip
DRAFT_OPTIONS = ("draft_vocab", "epochs", "batch_size", "learning_rate", "ttt_length", "export_steps")


def made_with(res: dict, a: argparse.Namespace) -> dict:
    """This call's options, once checked against those the work folder was made with: a target's always,
    the drafts' while drafts/ holds drafts made with them. Differing, the call stops in one line."""
    before, now = res.get("made_with") or {}, {k: getattr(a, k) for k in TARGET_OPTIONS + DRAFT_OPTIONS}
    held = TARGET_OPTIONS + (DRAFT_OPTIONS if (a.work / "drafts").is_dir() else ())
    diff = [k for k in held if k in before and before[k] != now[k]]
    if diff:
        was = ", ".join(f"--{k.replace('_', '-')} {before[k]}" for k in diff)
        fix = "rm -rf its drafts/ and vocab/" if set(diff) <= set(DRAFT_OPTIONS) else "use another --work"
        raise SystemExit(f"{a.work} holds a scenario made with {was}, not this call's: {fix}")
    return now


def parse_args(argv=None) -> argparse.Namespace:
    about = "Does a draft trained on the recipe's shards make the target decode faster?"
    ap = argparse.ArgumentParser(description=about)
    ap.add_argument("step", choices=["all", "target", "data", "extract", "train", "serve"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/draft"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--target-seconds", type=float, default=100)
    # 16 layers, not 8: the EAGLE-3 slots lie further apart ([2, 8, 13] against [2, 4, 5]; layers 2 and 13,
    # which the permuted control swaps, at cosine 0.45 where 2 and 5 were at 0.72), and the permuted
    # draft keeps 62 % of the real one's acceptance where it kept 85 % at 8
    ap.add_argument("--target-layers", type=int, default=TARGET["num_hidden_layers"])
    # The final norm weight's log-normal spread (spread_final_norm) sets what the wrong-norm control
    # costs: at 3.0 the wrong teacher's argmax differs at 75 % of positions (the draft accepts 0.36x);
    # at 1.5 at 17 % (0.93x). With --fp8 the default is 1.0: at 3.0 a token's final state spans 1e8 across
    # channels, past e4m3's range within a row, and the run's self-check refuses the fp8 set (as it would
    # a user's model like it)
    ap.add_argument("--norm-spread", type=float, default=None, help="default 3.0; with --fp8, 1.0")
    # The measure decodes greedily, so the draft learns the target's greedy replies (SpecForge's
    # regenerate_train_data.py samples at 0.7 by default, for sampled serving)
    ap.add_argument("--data-temperature", type=float, default=0.0)
    ap.add_argument("--train-conversations", type=int, default=6000)
    ap.add_argument("--eval-prompts", type=int, default=64)
    # 4 epochs of 6,000 (372 steps): the drafts converge (first-step accuracy ~0.92). At 3 epochs of
    # 5,000 (234 steps) they stop mid-way through the jump in accuracy each makes at its own step, and
    # arm-to-arm differences swamp what the controls change
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--learning-rate", type=float, default=2e-3)
    # SpecForge's default unrolls 7 draft steps. Serving drafts 3 tokens (--speculative-num-steps 3):
    # one from the draft's pass over the target's states, two from its own (SGLang's eagle_worker_v2
    # draft loop), which are unrolled positions 0-2; a 4th costs a quarter more training for a
    # position nothing serves
    ap.add_argument("--ttt-length", type=int, default=3)
    # the export arm trains the first N steps of the same schedule, compared step for step with the
    # direct arm (0: the whole run, and it is served too)
    ap.add_argument("--export-steps", type=int, default=60)
    # A real vocabulary (the byte tokenizer has 256 ids): a BPE tokenizer of this many ids, trained on
    # the target's own text (tokenizer.py); 0 keeps the byte one
    ap.add_argument("--bpe-vocab", type=int, default=0)
    # The draft predicts over this many ids, mapped from the shards' token counts (`python -m recipe.shards
    # vocab-map`); 0: the target's whole vocabulary. Adds the full-vocabulary and other-data arms
    ap.add_argument("--draft-vocab", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="the real draft (and the fp8 one) at seeds 0..N-1")
    ap.add_argument("--fp8", action="store_true", help="also extract with shards.codec=fp8 and train drafts on it")
    # Which slot an fp8 draft's loss comes from: the lossless set read with the final slot alone, or the
    # aux slots alone, quantized and dequantized as the fp8 codec stores them (fp8slots.py)
    ap.add_argument("--fp8-slots", action="store_true", help="with --fp8: also the fp8_final and fp8_aux arms")
    # Arms compared with each other share one call: the target is trained for --target-seconds, so another
    # call's target differs. A call that must fit its time limit trains the arms named (real always)
    ap.add_argument("--arms", default="", help="comma-separated: only these arms (default: every arm)")
    # The target answers in a style of its own (chat.styled) and the data holds the files' original answers;
    # the recipe's data.regenerate has the target rewrite them: drafts from its answers against drafts from
    # the original ones (with --seeds)
    ap.add_argument("--regen", action="store_true")
    a = ap.parse_args(argv)
    if a.fp8_slots and not a.fp8:
        ap.error("--fp8-slots compares with the fp8 set's drafts: add --fp8")
    if a.norm_spread is None:
        a.norm_spread = 1.0 if a.fp8 else 3.0
    return a


def main(argv=None) -> int:
    t_start = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_sftrain"]:  # before argparse: the export's own options (--to, ...) ride along
        return sf_train(*argv[1:])
    a = parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    res_path = a.work / "results.json"
    res = json.loads(res_path.read_text()) if res_path.exists() else {}
    res["made_with"] = made_with(res, a)
    plan = dict(epochs=a.epochs, batch_size=a.batch_size, learning_rate=a.learning_rate, ttt_length=a.ttt_length,
                export_steps=a.export_steps, draft_vocab=a.draft_vocab, seeds=a.seeds, fp8=a.fp8, regen=a.regen,
                fp8_slots=a.fp8_slots,
                only=[x for x in a.arms.split(",") if x])  # fmt: skip
    warm = None
    if a.step == "all" and "target" not in res and not a.regen:  # --regen's data step serves nothing
        warm = server(a.work, "data-target", a.work / "target-init", 31000, flags=DATA_SERVE)
    ran_now = set()
    with Serving(a.work, plan) as serving:
        steps = {
            "target": lambda: train_target(
                a.work,
                a.target_seconds,
                a.norm_spread,
                warm,
                layers=a.target_layers,
                bpe_vocab=a.bpe_vocab,
                style=a.regen,
            ),
            "data": lambda: (
                original_data(a.work, a.train_conversations, a.eval_prompts)
                if a.regen
                else make_data(a.work, a.train_conversations, a.eval_prompts, a.data_temperature, warm)
            ),
            "extract": lambda: extract(a.work, fp8=a.fp8, regen=a.regen, arms=arms(plan)),
            "train": lambda: train_drafts(a.work, plan, serving),
            "serve": lambda: serve(a.work, serving),
        }
        for name, step in steps.items():
            if a.step in ("all", name) and (name not in res or a.step == name or ran_now
                                            or unfinished(a.work, name, plan)):  # fmt: skip
                t0 = time.monotonic()
                ran_now.add(name)
                res[name] = kept(res.get(name), step(), name, a.work)
                res[name]["step_seconds"] = round(time.monotonic() - t0, 1)
                log(f"step {name}: {res[name]['step_seconds']} s")
                res_path.write_text(json.dumps(res, indent=1))
    res["call_seconds"] = round(time.monotonic() - t_start, 1)  # this invocation, start to servers stopped
    if "serve" in res:
        res["goals"] = goals(res, ran_now)
    report(res, a.out)
    return 0


def kept(before: dict | None, now: dict, name: str, work: Path) -> dict:
    """A train or serve step run again for other arms (a later call on the same work folder: the same
    target) keeps what it recorded for the arms it did not run now whose drafts are still there (drafts/
    removed for other draft options: none), so that one draft.json compares arms two calls made."""
    key = {"train": "arms", "serve": "acceptance"}.get(name)
    if before and key and isinstance(before.get(key), dict):
        there = {arm: v for arm, v in before[key].items() if (work / "drafts" / f"{arm}-curve.json").exists()}
        now[key] = {**there, **now.get(key, {})}
    return now


def report(res: dict, out: Path | None) -> None:
    """The results, printed and (given --out) written: the bench's JSON."""
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        out.write_text(text)
