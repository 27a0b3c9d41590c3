"""Step 1: a Llama-shaped byte-level target, trained for a few minutes, saved as bf16 safetensors."""

from __future__ import annotations

import functools
import json
import math
import random
import time
from pathlib import Path

from .chat import Chat, corpus, styled, window
from .common import TARGET, log
from .tokenizer import bpe_tokenizer


def save_target(model, tok, out: Path) -> None:
    """bf16 safetensors that SGLang and HF both load, with an *.index.json: SpecForge's TargetHead finds
    lm_head through one (one-file checkpoints have none)."""
    import copy

    import torch
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def target_model(chat: Chat, seed: int, config: dict = TARGET):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=chat.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=chat.bos,
        eos_token_id=chat.eot,  # the reply ends at <|eot_id|>: generation stops there
        pad_token_id=chat.pad,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def target_batch(files: list[bytes], r: random.Random, n: int, chat: Chat, dev: str, style: bool = False):
    """n conversations from random windows (each reply in the target's own style, given `style`), padded to
    the longest; labels on every real token."""
    import torch

    pairs = [window(files, r) for _ in range(n)]
    convs = chat.conversations([(u, styled(a)) for u, a in pairs] if style else pairs)
    ids = torch.full((n, max(map(len, convs))), chat.pad, dtype=torch.long)
    for i, c in enumerate(convs):
        ids[i, : len(c)] = torch.tensor(c)
    labels = ids.masked_fill(ids == chat.pad, -100)
    return ids.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)


def train_target(
    work: Path,
    seconds: float,
    sigma: float,
    warm=None,
    seed: int = 0,
    layers: int = TARGET["num_hidden_layers"],
    bpe_vocab: int = 0,
    style: bool = False,
) -> dict:
    """`warm`: a data server to start on the untrained weights (saved first), compiling SGLang's
    kernels on a fresh machine while the target trains; the data step loads the trained weights into it.
    `bpe_vocab`: a BPE tokenizer of that many ids, trained on the held-in files (else the byte one).
    `style`: the target answers in its own style (chat.styled), not the files' (--regen)."""
    import torch

    from recipe.models import make_tokenizer

    out = work / "target"
    if (out / "target.json").exists():
        return json.loads((out / "target.json").read_text())
    held_in, held_out = corpus()
    tok = bpe_tokenizer(held_in, bpe_vocab) if bpe_vocab else make_tokenizer("llama3")
    chat = Chat(tok)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a plumbing check
    config = dict(TARGET, num_hidden_layers=layers)
    model = target_model(chat, seed, config).to(dev)
    if warm is not None:  # first: a fresh machine's kernels take longer to compile than the target to train
        save_target(model, tok, work / "target-init")
        warm.start()
    mb = sum(map(len, held_in)) >> 20
    log(f"target: {len(tok)} token ids; {len(held_in)} held-in files, {len(held_out)} held-out, {mb} MB")
    rng, eval_rng = random.Random(seed), random.Random(seed + 1)
    batch = functools.partial(target_batch, chat=chat, dev=dev, style=style)

    loss_of = functools.partial(causal_loss, model, dev)
    t0 = time.monotonic()
    step, curve = fit(model, loss_of, lambda: batch(held_in, rng, 96), seconds)
    info = {"steps": step, "seconds": round(time.monotonic() - t0, 1), "conversations_seen": step * 96}
    evals = [batch(held_out, eval_rng, 64) for _ in range(16)]
    info.update(held_out_and_spread(model, loss_of, evals, seed, sigma))
    info.update(curve=curve, config=config, tokenizer={"kind": "bpe" if bpe_vocab else "byte", "ids": len(tok)})
    info["reply_style"] = "styled (tabs, single quotes)" if style else "the files'"
    save_target(model, tok, out)
    # The trainers and servers that follow need the GPU: a 16K-id target's activations left 58 GB in this
    # process's cache, and the drafts' trainers ran out of memory beside it on an 80 GB H100
    del model, loss_of, evals
    torch.cuda.empty_cache()
    (out / "target.json").write_text(json.dumps(info, indent=1))
    log(f"target: held-out loss {info['held_out_loss_nats_per_token']:.3f} nats/token after {step} steps")
    return info


def causal_loss(model, dev: str, ids, labels):
    import torch

    with torch.autocast(dev, dtype=torch.bfloat16):
        return model(input_ids=ids, labels=labels).loss


def fit(model, loss_of, next_batch, seconds: float) -> tuple[int, list]:
    """AdamW for `seconds`, the learning rate warmed up over 100 steps then cosine to a tenth; returns the
    steps taken and the loss every 100 steps."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    t0, step, curve = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - t0) < seconds:
        lr = 2e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / seconds)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_of(*next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            curve.append((step, round(elapsed, 1), round(loss.item(), 4)))
            log(f"target step {step} {elapsed:.0f}s loss {loss.item():.3f} lr {lr:.2e}")
        step += 1
    return step, curve


def held_out_and_spread(model, loss_of, evals: list, seed: int, sigma: float) -> dict:
    """The held-out loss, the final norm spread (spread_final_norm), and the loss again on the same
    batches: the same function, so the same loss."""
    import torch

    model.eval()
    with torch.no_grad():
        before = sum(loss_of(*b).item() for b in evals) / len(evals)
        spread = spread_final_norm(model, seed, sigma)
        after = sum(loss_of(*b).item() for b in evals) / len(evals)
    return {
        "held_out_loss_nats_per_token": round(after, 4),
        "held_out_bits_per_byte": round(after / math.log(2), 4),
        "held_out_loss_before_norm_spread": round(before, 4),
        "final_norm_spread": spread,
    }


def spread_final_norm(model, seed: int, sigma: float) -> dict:
    """The same function with an uneven final norm weight: channel j of the final RMSNorm's weight
    times s_j (log-normal) and lm_head's column j divided by s_j, so lm_head(norm(x)) is unchanged
    (up to bf16 rounding). A weight near 1 everywhere, as a few minutes of training leave it, makes
    post/w and post pick the same token, and the wrong-norm control could not show; trained large
    models' final norm weights are far from uniform, and small on the few channels where their
    residual stream carries massive activations, which a pre-norm state then feeds lm_head at full
    size. How much the wrong-norm control costs depends on sigma: the wrong teacher is lm_head over
    the normed state divided by s, so its argmax follows the channels with the smallest s (at 3.0,
    over 512 channels, s spans about 1e-4 to 1e4)."""
    import torch

    w, head = model.model.norm.weight, model.lm_head.weight  # [H], [V, H]
    g = torch.Generator().manual_seed(seed + 3)
    s = torch.exp(sigma * torch.randn(w.shape[0], generator=g)).to(w.device)
    w.mul_(s)
    head.div_(s)
    return {"sigma": sigma, "norm_weight_min_max_std_mean": weight_spread(w)}


def weight_spread(w) -> list[float]:
    """min, max, std, mean of a norm weight: how far from uniform it is."""
    return [round(float(x), 4) for x in (w.min(), w.max(), w.std(), w.mean())]
