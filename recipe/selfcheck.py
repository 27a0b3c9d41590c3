"""The in-run self-check: on the first samples of an SGLang run, the stored final slot goes through the
checkpoint's own final layer and must give the server's own input-token logprobs.

SGLang computes a prompt token's logprob as log_softmax(lm_head(final state)) (softcapped where the
config says so), from the very state the hook dumps. So lm_head(final slot) read back from the shards
must agree with what the server answered, up to bf16 rounding of the logits (in an fp8 set, also up to
five standard deviations of what e4m3's rounding of the stored state moves each logprob). A pre-norm state, a
state from another layer or one shifted by a token does not, by far (on the H200: 0.002-0.004 nats
for the final slot, 0.6-1.3 for the last aux slot through the same head). This guards every
architecture the seam serves, proven or not, at the cost of one lm_head read at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UserError
from .schema import ClientConfig
from .shards import codec
from .shards import fp8 as codec_fp8

log = logging.getLogger(__name__)

POSITIONS = 32  # prompt positions checked per sample, spread over it
OUTLIERS = 0.1  # the share of positions allowed past the bound before the run is refused
SIGMAS = 5.0  # an fp8 set: how many standard deviations of its rounding's effect a logprob may move
# ... and the most that standard deviation may be (median over a sample's positions): past it, SIGMAS of it
# pass a slot one layer off (about a nat away, on the H200), and a draft's teacher lies that far off
FP8_ROUNDING = 0.25


class SelfCheckFailed(UserError, RuntimeError):
    pass


def text_config(model_dir: Path) -> dict:
    outer = json.loads((Path(model_dir) / "config.json").read_text())
    return {**outer, **outer.get("text_config", {})}


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (the index when there is one)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    names = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names.update({k: f for k in st.keys()})
    return names


def head_name(names, tied: bool) -> str | None:
    """The language model's output layer: its lm_head, or its input embedding when the two are tied."""
    suffix = "embed_tokens.weight" if tied else "lm_head.weight"
    found = sorted((n for n in names if n.endswith(suffix) and "vision" not in n), key=len)
    return found[0] if found else None


@dataclass
class Head:
    """The checkpoint's final layer, read from its safetensors alone (no model load)."""

    weight: object  # torch [V, H], bf16 as stored
    softcap: float | None
    w32: object = None  # the weight in float32, made once at the first judgement (not per call)

    @classmethod
    def load(cls, model_dir: Path) -> Head | None:
        """None when it cannot be read as a plain float matrix (e.g. a quantized lm_head)."""
        import torch
        from safetensors import safe_open

        cfg = text_config(model_dir)
        files = weight_files(model_dir)
        tied = bool(cfg.get("tie_word_embeddings", False))
        name = head_name(files, tied) or head_name(files, not tied)
        if name is None:
            return None
        with safe_open(files[name], "pt") as st:
            w = st.get_tensor(name)
        if not w.is_floating_point() or w.element_size() < 2:
            return None
        cap = cfg.get("final_logit_softcapping")
        vocab = int(cfg.get("vocab_size") or w.shape[0])
        return cls(w[:vocab].to(torch.bfloat16), float(cap) if cap and cap > 0 else None)

    def widened(self):
        """The weight in float32, made once."""
        if self.w32 is None:
            self.w32 = self.weight.float()
        return self.w32

    def logprobs(self, states, targets, spread=None) -> tuple:
        """Per row: log p(target) under lm_head(state) in float32, and the row's largest |logit|. Given
        `spread` (each element's variance of the state's rounding: fp8_variance), also the standard
        deviation of log p(target) that rounding causes, to first order: |d log p / d state| weighted by it."""
        import torch

        w = self.widened()
        logits = states.float() @ w.T  # every sample's positions in one matmul: one pass over the head
        slope = None
        if self.softcap:
            capped = torch.tanh(logits / self.softcap)
            logits, slope = self.softcap * capped, 1 - capped * capped
        logp = torch.log_softmax(logits, -1)
        out = logp.gather(1, targets[:, None])[:, 0].double().numpy(), logits.abs().amax(1).double().numpy()
        if spread is None:
            return out
        grad = -logp.exp()  # d log p(target) / d logit: one-hot(target) - p
        grad[torch.arange(len(targets)), targets] += 1
        grad = (grad * slope if slope is not None else grad) @ w  # ... / d state
        return *out, (grad.pow(2) * spread).sum(-1).sqrt().double().numpy()


def fp8_variance(states):
    """Per element of an fp8 record's dequantized states [P, H]: the variance of the rounding it carries,
    e4m3's step at the value (its row scaled so that max|x| is e4m3's 448) then bf16's, each uniform
    over its step. Rows of a lossless record carry bf16's alone, which `bound` covers."""
    import torch

    x = states.float().abs()
    scale = x.amax(-1, keepdim=True).clamp_min(1e-30) / codec_fp8.MAX
    q = (x / scale).clamp_min(2.0**-6)  # below e4m3's smallest normal, its subnormal step
    e4m3 = torch.exp2(torch.floor(torch.log2(q)) - 3) * scale
    bf16 = torch.exp2(torch.floor(torch.log2(x.clamp_min(1e-30))) - 7)
    return (e4m3 * e4m3 + bf16 * bf16) / 12


def bound(max_logit: np.ndarray) -> np.ndarray:
    """How far a logprob from bf16 logits may be from ours: the logit's and the log-sum-exp's rounding,
    each within 2^-9 of the largest |logit|, times four."""
    return 0.02 + 2.0**-7 * max_logit


def positions(n: int) -> np.ndarray:
    """Up to POSITIONS prompt positions t (each predicting token t+1), spread from the first to the last."""
    return np.unique(np.linspace(0, n - 2, min(POSITIONS, n - 1)).round().astype(np.int64))


@dataclass
class Verdict:
    sample: str
    checked: int
    off: int
    max_diff: float
    allowed: float = 0.0  # what the bound allowed at that worst position
    rounding: float = 0.0  # an fp8 record: the median standard deviation its rounding moves a logprob by
    shifted: int | None = None  # reading row t+shift for token t makes them agree, if one does

    @property
    def ok(self) -> bool:
        return self.off <= OUTLIERS * self.checked

    @property
    def judged(self) -> bool:
        """Whether a wrong slot would show: not when the codec's rounding alone moves logprobs as far."""
        return self.rounding <= FP8_ROUNDING


def judge(head: Head, sample_id: str, ids: np.ndarray, final, server: list, fp8: bool = False) -> Verdict:
    """The final slot [n, H] (torch bf16) of one sample against the server's input-token logprobs
    (SGLang's list: [logprob, token id, ...] per prompt token, the first one's logprob None). fp8: the
    slot was stored by the fp8 codec, so each position may also move by its rounding (allowed)."""
    return judge_all(head, [(sample_id, ids, final, server)], fp8)[0]


def allowed(head: Head, states, targets, fp8: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: log p(target), how far the server's may be from it (bf16's bound, and for an fp8 record
    SIGMAS standard deviations of what its rounding moves), and that standard deviation (0: lossless)."""
    lp, peak, *sigma = head.logprobs(states, targets, fp8_variance(states) if fp8 else None)
    sigma = sigma[0] if fp8 else np.zeros_like(lp)
    return lp, bound(peak) + SIGMAS * sigma, sigma


def judge_all(head: Head, items: list, fp8: bool = False) -> list[Verdict]:
    """judge() for several samples (sample id, ids, final slot, server logprobs) at once: their positions
    through the head in one matmul. A sample that disagrees is tried shifted by a token either way."""
    import torch

    ts = [torch.as_tensor(positions(len(ids))) for _, ids, _, _ in items]
    states = torch.cat([final[t] for (_, _, final, _), t in zip(items, ts)])
    targets = torch.cat([torch.as_tensor(ids[t.numpy() + 1].astype(np.int64)) for (_, ids, _, _), t in zip(items, ts)])
    lp, limit, sigma = allowed(head, states, targets, fp8)
    out, at = [], 0
    for (sid, ids, final, server), t in zip(items, ts):
        want = np.asarray([server[i + 1][0] for i in t.tolist()], dtype=np.float64)
        k = len(t)
        diff, room = np.abs(lp[at : at + k] - want), limit[at : at + k]
        worst = int(diff.argmax())
        v = Verdict(sid, k, int((diff > room).sum()), float(diff[worst]), float(room[worst]),
                    float(np.median(sigma[at : at + k])))  # fmt: skip
        at += k
        if not v.ok:
            v.shifted = fitting_shift(head, ids, final, targets[at - k : at], want, t, fp8)
        out.append(v)
    return out


def fitting_shift(head: Head, ids: np.ndarray, final, targets, want: np.ndarray, t, fp8: bool) -> int | None:
    """The shift (-1 or 1) of rows that makes a disagreeing sample agree, if one does."""
    for shift in (-1, 1):
        lp, limit, _ = allowed(head, final[(t + shift).clamp(0, len(ids) - 1)], targets, fp8)
        if int((np.abs(lp - want) > limit).sum()) <= OUTLIERS * len(t):
            return shift
    return None


def unjudged(v: Verdict, name: str) -> str:
    return (
        f"self-check failed: the fp8 codec's rounding of {name}'s final state moves its logprobs by "
        f"{v.rounding:.3g} nats (one standard deviation, the median over sample {v.sample}'s {v.checked} positions): "
        "a wrong slot would pass, and a draft's teacher computed from it is that far off. The state spans more than "
        "e4m3's range within a token; store this model's set lossless (shards.codec=lossless)"
    )


def refusal(v: Verdict, name: str) -> str:
    why = (
        f"each row holds the final state of the token {'before' if v.shifted > 0 else 'after'} it"
        if v.shifted
        else "it is not the post-norm final state lm_head reads (pre-norm, or another layer's)"
    )
    return (
        f"self-check failed: the final slot of sample {v.sample} through {name}'s own lm_head disagrees with "
        f"the server's input-token logprobs at {v.off} of {v.checked} positions (worst {v.max_diff:.3g} nats, "
        f"{v.allowed:.3g} allowed there): "
        f"{why}. The dump is wrong for this architecture; the samples stored so far carry it"
    )


@dataclass
class SelfCheck:
    """Asks the server for logprobs on the first `samples` requests and judges each once stored."""

    model_dir: Path
    samples: int
    final_slot: int  # the final state's slot in a record
    asked: dict = field(default_factory=dict)  # sample key -> (sample id, the server's logprobs)
    verdicts: list = field(default_factory=list)
    seen: int = 0  # index records already looked at
    head: Head | None = None
    skipped: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # poll runs in worker threads
    threads: int = ClientConfig.self_check_threads  # torch's threads while it reads and judges (0: all)

    requested: int = 0

    def ask(self, sample) -> bool:
        """Whether this request asks for logprobs: the run's first `samples` of two tokens or more."""
        if self.requested >= self.samples or len(sample.input_ids) < 2 or self.skipped is not None:
            return False
        self.requested += 1
        return True

    def answered(self, sample, meta: dict) -> None:
        lps = meta.get("input_token_logprobs")
        if not lps or len(lps) != len(sample.input_ids):
            self.skipped = f"the server returned {len(lps or [])} input-token logprobs for {len(sample.input_ids)}"
            log.warning("self-check skipped: %s", self.skipped)
            return
        self.asked[sample.key] = (sample.id, lps)

    def poll(self, store) -> None:
        """Judge every asked sample the store has committed since the last call, together; raise on
        the first that disagrees."""
        with self.lock:
            records = store.records
            end = len(records)
            due = [rec for rec in records[self.seen : end] if rec["key"] in self.asked]
            self.seen = end
            if due and self._head() is not None:
                fp8 = (store.identity or {}).get("codec") == codec_fp8.NAME  # its rounding is the set's, allowed
                self._judge([self._item(store.root, rec) for rec in due], fp8)

    def _head(self) -> Head | None:
        """The checkpoint's lm_head, read once."""
        if self.head is None and self.skipped is None:
            self.head = Head.load(self.model_dir)
            if self.head is None:
                self.skipped = "the checkpoint's lm_head is not a plain float matrix"
                log.warning("self-check skipped: %s", self.skipped)
        return self.head

    def warm(self) -> None:
        """The head read and widened before the first samples come back (in a thread, while the server
        starts; a poll meanwhile waits on the lock)."""
        with self.lock, torch_threads(self.threads):
            t0, head = time.monotonic(), self._head()
            if head is not None:
                head.widened()
                log.info("self-check: lm_head read and widened in %.2f s", time.monotonic() - t0)

    def _item(self, root: Path, rec: dict) -> tuple:
        import torch

        sid, lps = self.asked.pop(rec["key"])
        _, t = codec.decode(read_frame(root, rec), rec["crc32"])
        final = torch.from_numpy(t["hidden"][:, self.final_slot].view(np.int16)).view(torch.bfloat16)
        return sid, t["input_ids"], final, lps

    def _judge(self, items: list, fp8: bool = False) -> None:
        t0 = time.monotonic()
        with torch_threads(self.threads):
            verdicts = judge_all(self.head, items, fp8)
        log.info("self-check: %d samples judged in %.2f s", len(items), time.monotonic() - t0)
        for v in verdicts:
            self.verdicts.append(v)
            if not v.judged:
                raise SelfCheckFailed(unjudged(v, Path(self.model_dir).name))
            if not v.ok:
                raise SelfCheckFailed(refusal(v, Path(self.model_dir).name))
            log.info("self-check: sample %s's final slot gives the server's logprobs (%d positions, worst %.3g "
                     "nats)", v.sample, v.checked, v.max_diff)  # fmt: skip

    def pending(self) -> int:
        return len(self.asked)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads capped at n for the block (0: as they are), then as they were. The
    count is the process's: during an SGLang capture nothing else in it runs torch (the packer's
    workers are processes of their own, forked before)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(min(n, before) if n > 0 else before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_frame(root: Path, rec: dict) -> bytes:
    fd = os.open(Path(root) / "shards" / rec["shard"], os.O_RDONLY)
    try:
        return os.pread(fd, rec["length"], rec["offset"])
    finally:
        os.close(fd)


async def judge_as_stored(check: SelfCheck, store) -> SelfCheckFailed | None:
    """While requests go out: each self-check sample judged as soon as the store has committed it (the
    head was made ready while the server started: SelfCheck.warm). It watches until every sample it
    asks for is judged, not until none is pending: at its first look the requests may be out and not
    yet answered (on an H100, the first answer came 0.4 s after the server was ready), and then the
    verdicts waited for the run's end. The run cancels it once every request is answered."""
    while len(check.verdicts) < check.samples and check.skipped is None:
        await asyncio.sleep(0.25)
        try:
            await asyncio.to_thread(check.poll, store)
        except SelfCheckFailed as e:
            return e
    return None


async def judge_the_rest(check: SelfCheck, packer) -> SelfCheckFailed | None:
    """Every request answered: the samples not judged yet, once stored; a probe sample that failed is
    a failed sample (counted as any other), so the wait ends when the packer holds nothing more."""
    while check.pending():
        try:
            await asyncio.to_thread(check.poll, packer.store)
        except SelfCheckFailed as e:
            return e
        if not check.pending() or not packer.outstanding():
            break
        await asyncio.sleep(0.1)
    if check.pending() and not check.skipped:
        log.warning("self-check: %d of its samples were not stored", check.pending())
    return None
