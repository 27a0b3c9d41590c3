"""The scenario's shape, the flags every server shares, and its log."""

from __future__ import annotations

import sys
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # `python bench/draft` runs it
ROOT = PACKAGE.parents[1]
sys.path.insert(0, str(ROOT))


TARGET = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4
)


def eagle3_layers(n_layers: int) -> list[int]:
    """SGLang's and SpecForge's default EAGLE-3 capture for N layers: outputs of layers
    [1, N//2-1, N-4] (their convention) = residual streams entering [2, N//2, N-3] (ours)."""
    return [2, n_layers // 2, n_layers - 3]


SPEC = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


# Same flags for every server, target alone included. Decode CUDA graphs stay off everywhere: the
# draft's graph capture imports deep_gemm, which the staged wheels lack; the comparison stays fair.
BASE = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--skip-tokenizer-init",
]  # fmt: skip


# Serving servers start while the drafts train: SGLang sizes its KV pool from the memory free at its own
# start less (1 - fraction) of it, so a low fraction fails when trainers take memory meanwhile; the pool
# itself stays capped by --max-total-tokens.
SERVE = BASE + ["--mem-fraction-static", "0.5", "--max-total-tokens", "65536"]


# The data server answers thousands of prompts at once (a larger batch and KV cache); it starts on the
# untrained target while the target trains, so a fresh machine compiles SGLang's kernels meanwhile.
DATA_SERVE = BASE + ["--mem-fraction-static", "0.4", "--max-total-tokens", "1048576", "--max-running-requests", "1024"]


USER_BYTES, REPLY_BYTES = (192, 384), 256


BATCH1_PROMPTS = 4  # decode speed at batch 1: 4 held-out prompts, up to 256 tokens each (steady ~1K tokens)


ARMS = ("real", "real_export", "permuted", "wrong_norm", "off_by_one", "untrained")
VOCAB_ARMS = ("full_vocab", "other_data", "shuffled")  # with a reduced draft vocabulary (--draft-vocab): its references
FP8_SLOT_ARMS = ("fp8_final", "fp8_aux")  # with --fp8-slots: the lossless set with these slots alone in fp8


def arms(plan: dict) -> tuple[str, ...]:
    """Every arm a scenario trains: the controls; with --draft-vocab the full-vocabulary draft and the
    mappings from other data and from the set's counts on shuffled ids; the real draft's further seeds
    (real_seedS); with --fp8 the real draft from the fp8 set, at each seed, and with --fp8-slots from
    the lossless set with the final slot or the aux slots alone in fp8, at each seed. With --regen: the real
    draft (from the target's own answers) and the draft from the original answers, at each seed."""
    n = range(1, plan.get("seeds", 1))
    if plan.get("regen"):  # the target's own answers (real) against the original ones, seed for seed
        every = ("real", *(f"real_seed{s}" for s in n), "original", *(f"original_seed{s}" for s in n))
    else:
        extra = VOCAB_ARMS if plan.get("draft_vocab") else ()
        fp8 = ("fp8",) if plan.get("fp8") else ()
        fp8 += FP8_SLOT_ARMS if plan.get("fp8_slots") else ()
        seeds = [f"real_seed{s}" for s in n] + [arm for k in fp8 for arm in (k, *(f"{k}_seed{s}" for s in n))]
        every = (*ARMS, *extra, *seeds)
    only = set(plan.get("only") or every) | {"real"}  # --arms: a call that fits its time; real is always served
    return tuple(arm for arm in every if arm in only)


def seed_of(arm: str) -> int:
    return int(arm.rsplit("_seed", 1)[1]) if "_seed" in arm else 0


# The export to SpecForge's files (8 processes) and both verifies run while the trainers start, off the
# critical path: at full priority beside them, the trainers' first 50 steps took about 80 s, against
# 22-25 s in bench/draft_peer.py, where neither runs
NICE = ["nice", "-n", "19"]


# The bench's servers hold nothing to keep: SGLang's SIGTERM path sleeps 5 s (crash diagnostics) before it
# exits, and several of those stops sit on the critical path; SIGKILL follows this grace
STOP_GRACE_S = 1


OWN_READER = ("real_export", "specforge_set")  # arms SpecForge trains through its own reader (its files)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)
