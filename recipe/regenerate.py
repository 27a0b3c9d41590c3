"""The target rewrites the assistant turns, then the capture prefills the whole conversation it wrote.

    python -m recipe data.regenerate.turns=last             # the last assistant turn of each record
    python -m recipe data.regenerate.turns=all              # every assistant turn, turn by turn

A draft learns what the target says; answers another model wrote teach it the wrong distribution.
Exact ids: a turn's prompt is the ids the conversation so far was stored with (template text
tokenized, earlier generated turns as generated), and its answer is stored as the backend returned
its token ids, never re-tokenized. The loss mask covers exactly the generated tokens, the template's
end-of-turn token included. Generation stops at that token, so a turn ends as the template ends it.
A turn that reaches max_new_tokens ends the conversation there (`cut: keep`) or skips the record.

Each generated turn is appended to `regenerated.jsonl` beside the shards (with the finished
conversation once its last turn is in): a resume reuses every turn it holds, and the file is the
regenerated data, reusable as it is. Its first line holds the settings; the identity holds them too,
so a set never mixes regenerated and original answers, or two settings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from .data import BadRecord, Sample, render, turn_end_marker
from .errors import UserError

log = logging.getLogger(__name__)
FILE = "regenerated.jsonl"
LOG_EVERY_S = 10.0


def settings(regen_cfg) -> dict:
    """What decides the generated tokens besides the model: in the identity and the file's first line."""
    r = regen_cfg
    return {"turns": str(getattr(r.turns, "value", r.turns)), "temperature": float(r.temperature),
            "top_p": float(r.top_p), "max_new_tokens": int(r.max_new_tokens), "seed": int(r.seed),
            "cut": str(getattr(r.cut, "value", r.cut))}  # fmt: skip


def decode_graphs(cfg) -> None:
    """Regeneration decodes, so SGLang's decode CUDA graphs go on (its default): the dump acts on prefill
    passes only, and a graph replay runs no Python."""
    if cfg.data.regenerate.turns != "off" and cfg.backend.name == "sglang":
        cfg.server.args.cuda_graph_backend_decode = None


def stop_token(tokenizer, template_kwargs=None) -> int:
    """The template's end-of-turn marker as one token id: where generation stops, as the template ends a turn."""
    marker = turn_end_marker(tokenizer, template_kwargs)
    ids = tokenizer.encode(marker, add_special_tokens=False) if marker else []
    if len(ids) != 1:
        raise UserError(
            f"data.regenerate: this chat template ends an assistant turn with {marker!r}, not one token; "
            "regeneration stops at that token and needs one"
        )
    return ids[0]


def turn_seed(seed: int, sample_id: str, message: int) -> int:
    """Each turn's sampling seed: the same for a turn whatever the batch, the order or a resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample_id}/{message}".encode()).digest()[:4], "little")


class Journal:
    """regenerated.jsonl: the settings, then each generated turn, then each finished conversation."""

    def __init__(self, out: Path, regen: dict):
        self.path = Path(out) / FILE
        self.turns: dict[tuple[str, int], dict] = {}
        self.lock = threading.Lock()  # records are written side by side (data.regenerate.concurrency)
        if self.path.is_symlink():  # appending and cutting a torn line would go to the user's file
            raise UserError(f"{self.path} is a link; regeneration writes its own file there: move the link away")
        if self.path.exists():
            self._read(regen)
        if not self.path.exists() or not self.path.stat().st_size:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"settings": regen})

    def _read(self, regen: dict) -> None:
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # a last line with no newline was cut short by a crash: redone
        for n, line in enumerate(whole.splitlines()):
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"{self.path}: line {n + 1} is not JSON; move the file away to regenerate") from None
            if "settings" in row and row["settings"] != regen:
                raise UserError(f"{self.path} was written with {row['settings']}, not {regen}")
            if "turn" in row:
                self.turns[(row["turn"]["id"], row["turn"]["message"])] = row["turn"]
        if len(whole) < len(data):
            with open(self.path, "r+b") as f:  # so that what follows starts a line of its own
                f.truncate(len(whole))

    def _append(self, row: dict) -> None:
        with self.lock, open(self.path, "ab") as f:
            f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())

    def turn(self, sample_id: str, message: int, generated: list[int], finished: bool) -> dict:
        row = {"id": sample_id, "message": message, "generated": [int(i) for i in generated], "finished": finished}
        self._append({"turn": row})
        self.turns[(sample_id, message)] = row
        return row

    def progress(self, done: int, total: int, t0: float) -> None:
        """A line every LOG_EVERY_S while the target writes: decode is most of the cost."""
        now = time.monotonic()
        if now - getattr(self, "_logged", t0) >= LOG_EVERY_S or done == total:
            self._logged = now
            log.info("regenerated %d of %d samples (%d turns in %s, %.0f s)", done, total, len(self.turns), FILE,
                     now - t0)  # fmt: skip

    def conversation(self, sample: Sample, messages: list[dict], tools) -> None:
        self._append({"conversation": {"id": sample.id, "messages": messages, **({"tools": tools} if tools else {}),
                                       "input_ids": sample.input_ids.tolist()}})  # fmt: skip


@dataclasses.dataclass
class Regenerator:
    """Turns records' conversations into the samples the target wrote (see the module's text)."""

    tokenizer: object
    data_cfg: object
    journal: Journal
    key_of: object  # ids -> the sample's resume key
    stop: int = -1

    @classmethod
    def open(cls, data_cfg, tokenizer, out: Path, key_of) -> Regenerator:
        regen = settings(data_cfg.regenerate)
        kwargs = dict(data_cfg.chat_template_kwargs or {})
        return cls(tokenizer, data_cfg, Journal(out, regen), key_of, stop_token(tokenizer, kwargs))

    def settle(self, plan) -> None:
        """Each planned sample as the target wrote it where the file holds all its turns; the others
        still to write (no key: none is stored yet). A record the file says to skip leaves the plan."""
        kept = []
        for s in plan.samples:
            try:
                r = self.sample(s)
            except BadRecord as e:
                plan.skip(e.reason, s.source, str(e))
                continue
            kept.append(r if r is not None else dataclasses.replace(s, key=""))
        plan.samples[:] = kept

    def complete(self, job, backend, stop) -> list[Sample]:
        """The target writes every turn still to write, through the backend (data.regenerate.concurrency
        records at once where the backend batches them, a server; else one at a time); returns what the
        capture prefills. A stop, or a record whose turn the backend
        failed to write, leaves that record not done (job.todo keeps it: the run says so, a resume
        writes it), and never sends its original answers to the capture."""
        generate = functools.partial(backend.generate, regen=self.data_cfg.regenerate, stop=self.stop)
        at = {s.id: i for i, s in enumerate(job.plan.samples)}
        ready = [s for s in job.todo if s.conversation is None]  # rebuilt from the file at plan time
        left, unwritten, t0 = [s for s in job.todo if s.conversation is not None], [], time.monotonic()
        if left and hasattr(backend, "up"):  # a server launched from this thread: one launched from a pool
            backend.up()  # thread gets its parent-death signal when that thread ends, mid-run
        workers = self.data_cfg.regenerate.concurrency if getattr(backend, "batches_generation", False) else 1
        with ThreadPoolExecutor(workers) as pool:
            jobs = {pool.submit(self.sample, s, generate): s for s in left}
            for n, f in enumerate(as_completed(jobs), 1):
                s = jobs[f]
                if stop.is_set():
                    pool.shutdown(cancel_futures=True)
                if f.cancelled():
                    unwritten.append(s)
                    continue
                try:
                    r = f.result()
                except BadRecord as e:
                    job.plan.skip(e.reason, s.source, str(e))
                    job.plan.samples[at[s.id]] = None
                    continue
                except Exception as e:  # noqa: BLE001  (the server failed this turn: the record is not done)
                    log.error("regenerating %s failed: %s: %s", s.id, type(e).__name__, e)
                    unwritten.append(s)
                    continue
                job.plan.samples[at[s.id]] = r
                ready += [r] if r.key not in job.store.keys else []
                self.journal.progress(n, len(left), t0)
        job.plan.samples[:] = [x for x in job.plan.samples if x is not None]
        job.todo = ready + unwritten
        return ready

    def sample(self, s: Sample, generate=None) -> Sample | None:
        """The sample as the target wrote it; None where a turn is still to generate and no `generate`
        (prompt ids, seed) -> generated ids was given. Raises BadRecord for one to skip."""
        messages, tools = s.conversation
        kwargs = {**(self.data_cfg.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        msgs, targets = rewritten(messages, self.data_cfg.regenerate.turns)
        ids, mask, done, fresh = [], [], "", False  # done: the rendered text the stored ids stand for, so far
        for k in targets:
            head = render(self.tokenizer, msgs[:k], True, kwargs)
            if not head.startswith(done):
                raise BadRecord("template_not_prefix_stable", f"turn {k} after a regenerated turn")
            piece = self.tokenizer.encode(head[len(done) :], add_special_tokens=False)
            ids, mask = ids + piece, mask + [0] * len(piece)
            turn = self.journal.turns.get((s.id, k))
            if turn is None and generate is None:
                return None
            if turn is None:
                gen = generate(ids, turn_seed(self.data_cfg.regenerate.seed, s.id, k))
                turn, fresh = self.journal.turn(s.id, k, gen, bool(gen) and gen[-1] == self.stop), True
            ids, mask = ids + turn["generated"], mask + [1] * len(turn["generated"])
            text = self.tokenizer.decode(turn["generated"][: -1 if turn["finished"] else None])
            msgs[k] = {**msgs[k], "content": text}
            if not turn["finished"]:
                if self.data_cfg.regenerate.cut == "skip":
                    raise BadRecord("regenerate_cut", f"turn {k} reached max_new_tokens")
                msgs = msgs[: k + 1]
                break
            done = render(self.tokenizer, msgs[: k + 1], False, kwargs).rstrip()  # up to its end-of-turn
        return self.finish(s, msgs, tools, ids, mask, fresh)

    def finish(self, s: Sample, msgs, tools, ids: list, mask: list, fresh: bool) -> Sample:
        """The regenerated sample, cut to max_length as the plan cuts any; its conversation into the
        file once, when its last turn was generated now."""
        out = dataclasses.replace(s, input_ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, np.uint8))
        if fresh:
            self.journal.conversation(out, msgs, tools)
        n = self.data_cfg.max_length
        if len(ids) > n:
            if self.data_cfg.overflow == "skip":
                raise BadRecord("too_long", f"{len(ids)} > max_length {n} after regeneration")
            out = dataclasses.replace(out, input_ids=out.input_ids[:n], loss_mask=out.loss_mask[:n], truncated=True)
            if not out.loss_mask.any():
                raise BadRecord("no_loss_tokens", f"no generated token within max_length {n}")
        return dataclasses.replace(out, key=self.key_of(out.input_ids), conversation=None)


def rewritten(messages: list[dict], turns) -> tuple[list[dict], list[int]]:
    """The conversation up to its last assistant turn, and the turns the target rewrites: the last one,
    or all of them in order. A conversation that ends on a prompt (a `prompt` record with no answer,
    say) gets an answer to it as its last turn."""
    msgs = [dict(m) for m in messages]
    if msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": ""})
    assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    msgs = msgs[: assistant[-1] + 1]
    return msgs, assistant[-1:] if str(getattr(turns, "value", turns)) == "last" else assistant
