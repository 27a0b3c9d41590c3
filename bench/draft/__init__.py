"""Does a draft trained on the recipe's shards make the target decode faster? The shards' purpose,
measured end to end on one GPU, with controls that show the measure sees bad data.

    python bench/draft all --work /tmp/draft --out draft.json     # GPU host, SGLang 0.5.16 + SpecForge 0.2.0
    python bench/draft all --bpe-vocab 16384 --draft-vocab 4096 --out draft-vocab.json   # the reduced vocabulary
    python bench/draft all --bpe-vocab 16384 --draft-vocab 4096 --seeds 3 --fp8 \
        --arms real_seed1,real_seed2,fp8,fp8_seed1,fp8_seed2 --out draft-fp8.json       # fp8 against lossless
    python bench/draft all --bpe-vocab 16384 --draft-vocab 4096 --seeds 3 --fp8 --fp8-slots \
        --arms fp8_final,fp8_final_seed1,fp8_final_seed2,fp8_aux,fp8_aux_seed1,fp8_aux_seed2 \
        --out draft-fp8-slots.json      # then, on the same work folder: which slot fp8 costs

Steps (each a subcommand; `all` runs them in order and skips what the work folder already holds, so a
later call resumes where an earlier one stopped; one that names other arms keeps what the earlier one
trained and served, so its report compares them all):
  target   a Llama-shaped byte-level target (16 layers by default, hidden 512) trained for a few minutes on the
           host's Python sources in chat form (a short system turn, a code window as the user turn,
           what follows as the reply); held-out loss on files it never saw; then its final norm
           weight made uneven without changing its function (spread_final_norm); bf16 safetensors
           that SGLang and HF both load.
           Under `all`, the data server starts on the untrained weights meanwhile (a fresh machine
           compiles SGLang's kernels while the target trains)
  data     the target served by SGLang (the trained weights loaded into that server through
           /update_weights_from_disk, checked by a reply that changes; else a fresh server): held-in
           prompts answered by the target itself (as EAGLE-3 practice regenerates data; greedy by
           default, as the measure decodes), sent as batch requests, written as chat JSONL; held-out prompts kept aside
  extract  `python -m recipe backend=sglang ...` as a user runs it, at the EAGLE-3 default layers for
           the saved target's depth; and, at the same time, the same run one layer deeper (the
           off-by-one control's shards, where the call trains that arm)
  train    SpecForge 0.2.0's own `specforge train` (its CLI, config schema, sampler, collator, loss),
           every arm at once: reading the shards directly (recipe.shards.trainers.specforge_reads_shards),
           from `python -m recipe.shards export --to specforge` (the first --export-steps steps of the
           same schedule, compared step for step), and the controls; then `specforge export --to
           sglang` for each served draft. Also each control's size in the data (control_sizes): how
           often the wrong-norm teacher's argmax differs, and how far apart the slots a permuted draft
           confuses are
  serve    SGLang 0.5.16 with each draft (--speculative-algorithm EAGLE3, 3 steps, top-k 1, 4 draft
           tokens) on held-out prompts: acceptance length for every draft, decode tokens/s at batch 1
           and 16 for the real draft and for the target alone. Each server starts as soon as its
           draft is exported (the target's when training starts), so start-ups overlap the training;
           a control's acceptance is measured as soon as its server is up (a count, not a timing);
           decode speed with the GPU to itself (class Serving)

A real vocabulary and the draft users train (`--bpe-vocab 16384 --draft-vocab 4096`): the target gets a
BPE tokenizer trained on its own text (tokenizer.py), the draft predicts over a quarter of its ids through
the recipe's mapping (`python -m recipe.shards vocab-map` on the shards, given to SpecForge as
model.vocab_mapping_path; its export writes d2t, which SGLang's EAGLE3 loads), beside full_vocab (the
whole vocabulary), other_data (the same rule on the host's prose counts) and shuffled (on the set's
counts moved to other ids; vocab.py). `--seeds N`
trains the real draft at seeds 0..N-1, `--fp8` also extracts with shards.codec=fp8 and trains the same
seeds on that set (goals: the means and standard errors); `--fp8-slots` adds, at each seed, drafts from
the lossless set with the final slot alone (fp8_final) or the aux slots alone (fp8_aux) quantized as
the fp8 codec stores them: which slot an fp8 draft's loss comes from (fp8slots.py). `--arms` trains
only the arms named (and real): arms compared with each other must share a call, since each call trains its own target.

Controls (same training, one thing wrong):
  permuted     aux slots concatenated in another order than the draft config's
  wrong_norm   the last slot as a pre-norm state where SpecForge wants the state fed to lm_head
  off_by_one   shards captured one layer deeper than the draft config claims
  untrained    the draft as initialised (learning rate ~0, one step)

One module per step (target, data, extract, train, serve), the controls' wrong data in controls, the
chat form of the text in chat, servers and the client in servers; scenario runs them in order.
"""

from . import chat, tokenizer
from .chat import SYSTEM, Chat, corpus, window
from .common import ARMS, STOP_GRACE_S, TARGET, arms, eagle3_layers, log
from .controls import control_sizes, permuted, slot_distances, wrong_norm
from .data import eval_prompts, make_data, system_message
from .extract import capture_runs, extract, recipe_argv
from .fp8slots import fp8_aux, fp8_final, fp8_roundtrip, fp8_sizes
from .scenario import main, parse_args, report
from .serve import Serving, serve, stop_ids
from .servers import decode_figures, eagle3_server, server
from .target import save_target, spread_final_norm, target_model, train_target
from .train import (
    arm_inputs,
    draft_json,
    finish_arm,
    launch_arm,
    run_yaml,
    served_arms,
    sf_train,
    sftrain_argv,
    sglang_export_args,
    train_drafts,
)

__all__ = [
    "chat",
    "tokenizer",
    "arm_inputs",
    "SYSTEM",
    "Chat",
    "corpus",
    "window",
    "ARMS",
    "arms",
    "STOP_GRACE_S",
    "TARGET",
    "eagle3_layers",
    "log",
    "control_sizes",
    "permuted",
    "slot_distances",
    "wrong_norm",
    "fp8_aux",
    "fp8_final",
    "fp8_roundtrip",
    "fp8_sizes",
    "eval_prompts",
    "make_data",
    "system_message",
    "capture_runs",
    "extract",
    "recipe_argv",
    "main",
    "parse_args",
    "report",
    "Serving",
    "serve",
    "stop_ids",
    "decode_figures",
    "eagle3_server",
    "server",
    "save_target",
    "spread_final_norm",
    "target_model",
    "train_target",
    "draft_json",
    "finish_arm",
    "launch_arm",
    "run_yaml",
    "served_arms",
    "sf_train",
    "sftrain_argv",
    "sglang_export_args",
    "train_drafts",
]
