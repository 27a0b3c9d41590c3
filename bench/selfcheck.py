"""The in-run self-check's CPU cost at a real target's head: what judging its samples takes, in the way it
judges now (the head widened to float32 once, every sample's positions in one matmul) against the way
it judged before (one sample at a time, the bf16 head widened chunk by chunk on every call).

  python bench/selfcheck.py --out docs/selfcheck.json          # Llama-3.1-8B's head: 128256 x 4096

Data: a bf16 head of the target's shape at init scale (std 0.02, as bench/shapes.py builds them), final
states at RMS 1 times a norm weight of 1 (what a post-norm final slot holds), 4 samples (client.self_check's
default) of 2,048 tokens, each judged at its 32 positions. The judgement does not depend on the
values: it is one matmul of [positions, H] by [H, V] and a log_softmax, so init-scale values time it
as a trained head would. The figures are the best of --repeat, on this machine's cores (torch threads).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from recipe.selfcheck import Head, judge_all, positions


def old_logprobs(head: Head, states, targets):
    """The judgement before: the bf16 head widened to float32 chunk by chunk on every call."""
    logits = torch.cat([states.float() @ w.float().T for w in head.weight.split(16384)], dim=1)
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    return lp.double().numpy(), logits.abs().amax(1).double().numpy()


def samples(head: Head, n: int, tokens: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        final = torch.randn(tokens, head.weight.shape[1], generator=g).to(torch.bfloat16)
        ids = torch.randint(0, head.weight.shape[0], (tokens,), generator=g).numpy()
        t = torch.as_tensor(positions(tokens))
        lp, _ = old_logprobs(head, final[t], torch.as_tensor(ids[t.numpy() + 1].astype(np.int64)))
        server = [[None, int(ids[0])]] + [[0.0, int(i)] for i in ids[1:]]
        for pos, v in zip(t.tolist(), lp):
            server[pos + 1][0] = float(v)
        out.append((f"s{k}", ids, final, server))
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    head = Head((torch.randn(a.vocab, a.hidden) * 0.02).to(torch.bfloat16), None)
    items = samples(head, a.samples, a.tokens)
    t0 = time.perf_counter()
    head.w32 = head.weight.float()
    widen_s = time.perf_counter() - t0

    def before():
        import recipe.selfcheck as sc

        saved, sc.Head.logprobs = sc.Head.logprobs, old_logprobs
        try:
            return [judge_all(head, [x]) for x in items]  # one sample per call, as it was judged
        finally:
            sc.Head.logprobs = saved

    now_s, before_s = best(lambda: judge_all(head, items), a.repeat), best(before, a.repeat)
    assert all(v.ok for v in judge_all(head, items))  # the same verdicts either way
    res = {"machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
           "head": [a.vocab, a.hidden], "samples": a.samples, "tokens": a.tokens, "repeat": a.repeat,
           "widen_once_s": round(widen_s, 3), "judge_all_now_s": round(now_s, 3),
           "judge_one_by_one_before_s": round(before_s, 3), "speedup": round(before_s / now_s, 2)}  # fmt: skip
    print(json.dumps(res, indent=2))
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
