"""A set's token counts: per token id, how often it appears in the stored samples' loss-masked
positions (what SpecForge and speculators build a draft vocabulary's d2t/t2d from) and in all positions.

They live beside the index as token_counts.npz and describe exactly the samples the index lists, in
index order: `lines` says how many index lines they cover and `digest` hashes those lines' sample
keys in order, so a file that does not match the index it sits beside (a run killed after it committed
lines, a repair that rewrote the index) is never trusted: the counts are brought up to the index from
the samples themselves (`record_tokens`, a few bytes of each record), or recounted.
Besides the counts, the order in which ids were first seen among loss-masked tokens (index order,
ascending ids within a sample): SpecForge's Counter breaks ties among equal counts that way.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CorruptFile
from .codec import CorruptRecord, record_tokens

log = logging.getLogger(__name__)

FILE = "token_counts.npz"
UNSET = np.iinfo(np.int64).max
VERSION = 1


def digest_of(records: list) -> bytes:
    """The sample keys of these index lines, in order, hashed (one call: 0.2 s over a million)."""
    return hashlib.sha256("\n".join(r["key"] for r in records).encode()).digest()


@dataclass
class Counts:
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per id, loss-masked tokens
    all: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per id, every token
    first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rank first seen loss-masked, -1 never
    ranked: int = 0
    lines: int = 0  # index lines (samples) counted, from the first
    digest: bytes = b""  # digest_of those lines, as last saved or read
    saved: int = -1  # the lines token_counts.npz on disk holds of these counts (-1: it holds none of them)
    place: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)  # for _rank

    def _grow(self, top: int) -> None:
        if top >= self.loss.size:
            n = max(top + 1, 2 * self.loss.size)
            for name, fill in (("loss", 0), ("all", 0), ("first", -1), ("place", UNSET)):
                old = getattr(self, name)
                new = np.full(n, fill, np.int64)
                new[: old.size] = old
                setattr(self, name, new)

    def add(self, key: str, ids, mask) -> None:
        """One more sample, the next in index order."""
        self.add_many([(ids, mask)])

    def add_many(self, samples: list[tuple]) -> None:
        """More samples, the next in index order, each (ids, loss mask), counted in a few numpy calls for
        them all: verify counts a range of samples at once, since per sample those calls cost more than
        the decode of a short chat."""
        ids, masks = [np.asarray(i) for i, _ in samples], [np.asarray(m) for _, m in samples]
        sizes = [i.size for i in ids]
        if sizes != [m.size for m in masks]:  # joined, a short mask would shift every later sample's
            raise ValueError("a sample's ids and loss mask differ in length")
        self.lines += len(samples)
        if not sum(sizes):
            return
        every = np.concatenate([i for i in ids if i.size]).astype(np.int64, copy=False)
        masked = np.flatnonzero(np.concatenate([m for m in masks if m.size]) == 1)  # places of loss tokens
        self._grow(int(every.max()))
        np.add.at(self.all, every, 1)  # not np.unique: 3x faster on a short chat, as fast on a long one
        loss = every[masked]
        np.add.at(self.loss, loss, 1)
        fresh = np.flatnonzero(self.first[loss] < 0)
        if fresh.size:  # in a call's first samples, and seldom after
            self._rank(loss, fresh, np.searchsorted(masked, np.cumsum(sizes)))

    def _rank(self, loss: np.ndarray, fresh: np.ndarray, ends: np.ndarray) -> None:
        """Rank the ids first seen at places `fresh` of `loss` (the loss-masked ids of samples, the k-th
        ending before place ends[k]) by the sample that first holds each, ascending within one."""
        ids = loss[fresh]
        # per id, its first place, in an array kept with the counts (not one the vocabulary's size each
        # call): each id written here is ranked below, so never fresh, never read here again
        np.minimum.at(self.place, ids, fresh)
        firsts = fresh[self.place[ids] == fresh]
        new = loss[firsts]
        new = new[np.lexsort((new, np.searchsorted(ends, firsts, side="right")))]  # by sample, ascending within one
        self.first[new] = self.ranked + np.arange(new.size)
        self.ranked += new.size

    def extend(self, other: Counts) -> None:
        """`other`'s samples appended after these: sums, and `other`'s ids not seen before ranked after
        these, in its own order."""
        ids, _ = other.counter()
        self._grow(int(max(other.loss.size, other.all.size)) - 1)
        self.loss[: other.loss.size] += other.loss
        self.all[: other.all.size] += other.all
        new = ids[self.first[ids] < 0]
        self.first[new] = self.ranked + np.arange(new.size)
        self.ranked += new.size
        self.lines += other.lines

    def counter(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, loss-masked counts) of every id seen in a loss-masked position, in first-seen order."""
        seen = np.flatnonzero(self.first >= 0)
        order = seen[np.argsort(self.first[seen], kind="stable")]
        return order, self.loss[order]

    def summary(self) -> dict:
        return {"file": FILE, "samples": self.lines, "loss_tokens": int(self.loss.sum()),
                "tokens": int(self.all.sum()), "distinct_loss_ids": self.ranked,
                "distinct_ids": int(np.count_nonzero(self.all))}  # fmt: skip

    def sparse(self) -> dict:
        """The counts as the ids seen: small for few samples, whatever the vocabulary (what the file
        holds, and what verify's workers send back)."""
        ids, loss = self.counter()
        every = np.flatnonzero(self.all)
        return dict(lines=self.lines, loss_ids=ids.astype(np.int32), loss_counts=loss,
                    all_ids=every.astype(np.int32), all_counts=self.all[every])  # fmt: skip

    @classmethod
    def of_sparse(cls, z, digest: bytes = b"") -> Counts:
        c = cls(lines=int(z["lines"]), digest=digest)
        ids, every = z["loss_ids"].astype(np.int64), z["all_ids"].astype(np.int64)
        c._grow(int(max(ids.max(initial=-1), every.max(initial=-1))))
        c.loss[ids], c.first[ids], c.all[every] = z["loss_counts"], np.arange(ids.size), z["all_counts"]
        c.ranked = ids.size
        return c

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, version=VERSION, digest=np.frombuffer(self.digest, np.uint8), **self.sparse())
        return buf.getvalue()

    @classmethod
    def from_file(cls, path: Path) -> Counts:
        with np.load(path) as z:
            if int(z["version"]) != VERSION:
                raise ValueError(f"token counts version {int(z['version'])}")
            return cls.of_sparse(z, z["digest"].tobytes())


def read_tokens(root: Path, rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """A stored sample's ids and loss mask, from its record's first bytes."""
    with open(Path(root) / "shards" / rec["shard"], "rb", buffering=1 << 16) as f:
        f.seek(rec["offset"])
        return record_tokens(f)


def tokens_or_none(root: Path, rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """A record's tokens; none for one that cannot give them (damaged, or ids and mask of two lengths:
    `verify` names it, a reader refuses it, and a trainer never sees its tokens)."""
    try:
        ids, mask = read_tokens(root, rec)
        if ids.shape == mask.shape:
            return ids, mask
    except (CorruptRecord, OSError):
        pass
    log.warning("token counts: sample %s does not give its tokens (see `verify`); counted as none", rec.get("id"))
    return np.zeros(0, np.int64), np.zeros(0, np.uint8)


def catch_up(counts: Counts, root: Path, records: list, cache: dict | None = None) -> Counts:
    """`counts` brought up to the index: every record past those counted, in order, its tokens from
    `cache` (key -> (ids, mask), taken out) or read from its record. A progress line on long work."""
    todo, t0, last = records[counts.lines :], time.monotonic(), time.monotonic()
    for i, rec in enumerate(todo):
        tokens = cache.pop(rec["key"], None) if cache else None
        counts.add(rec["key"], *(tokens if tokens is not None else tokens_or_none(root, rec)))
        if time.monotonic() - last > 10:
            log.info("token counts: %d of %d samples read (%.0f s)", i + 1, len(todo), time.monotonic() - t0)
            last = time.monotonic()
    return counts


def within(root: Path, records: list, max_length: int) -> Counts:
    """The counts of the samples cut to their first max_length tokens, as a trainer that truncates
    them counts (SpecForge's offline vocabulary mapping, data.max_length)."""
    counts = Counts()
    for rec in records:
        ids, mask = tokens_or_none(root, rec)  # as the uncut counts count a damaged record
        counts.add(rec["key"], ids[:max_length], mask[:max_length])
    return counts


def covers(counts: Counts, records: list) -> bool:
    """The counts are of the first `lines` samples the index lists, in its order, and their totals are
    those lines' (an edited file whose digest still matches is caught here, cheaply)."""
    if counts.lines > len(records) or digest_of(records[: counts.lines]) != counts.digest:
        return False
    head = records[: counts.lines]
    if int(counts.all.sum()) != sum(r.get("tokens", 0) for r in head):
        return False
    return all("loss_tokens" not in r for r in head) or int(counts.loss.sum()) == sum(
        r.get("loss_tokens", 0) for r in head
    )


def same(a: Counts, b: Counts) -> bool:
    """Equal counts, per id, and the same first-seen order (what a vocabulary mapping is built from)."""
    if a.lines != b.lines:
        return False
    n = max(a.loss.size, b.loss.size)
    for k, fill in (("loss", 0), ("all", 0), ("first", -1)):
        x, y = (np.concatenate([v, np.full(n - v.size, fill, np.int64)]) for v in (getattr(a, k), getattr(b, k)))
        if not np.array_equal(x, y):
            return False
    return True


def problem(root: Path, records: list, counted: Counts) -> str | None:
    """Why token_counts.npz does not hold these samples' counts, `counted` again from their records
    (verify's workers count them as they check each record); None where it does, or where there is no
    file (the next open writes it)."""
    path = Path(root) / FILE
    if path.is_dir():
        return f"{path} is a folder, not the set's token counts: move it away, then repair the set"
    if not path.exists():
        return None
    fix = f"`python -m recipe.shards repair {root}` counts them again from the records"
    try:
        saved = Counts.from_file(path)
    except Exception as e:  # any damage: a cut zip, a folder, a wrong array
        return f"{FILE} is unreadable ({type(e).__name__}): {fix}"
    wrong = f"{FILE} does not hold the counts of the samples the index lists: {fix}"
    if saved.lines != len(records) or not covers(saved, records):
        return wrong
    return None if same(saved, counted) else wrong


def load(root: Path, records: list, cache: dict | None = None) -> Counts:
    """The set's counts for exactly `records` (its index): the file where it matches, brought up to
    the index; else counted again from every stored sample."""
    path = Path(root) / FILE
    counts = None
    if path.exists():
        try:
            counts = Counts.from_file(path)
        except Exception as e:  # damaged in any way (a cut zip, a wrong array): derived data, counted again
            log.warning("%s is unreadable (%s); counting the stored samples' tokens again", path, e)
    if counts is None or not covers(counts, records):
        if records and counts is not None:
            log.warning("%s does not match the index; counting the stored samples' tokens again", path)
        counts = Counts()
    else:
        counts.saved = counts.lines
    if len(records) - counts.lines > 1000:
        log.info("token counts: reading %d stored samples' tokens", len(records) - counts.lines)
    return catch_up(counts, root, records, cache)


def save(root: Path, counts: Counts, records: list, write) -> None:
    """The counts of `records` (the index), replaced whole through `write(path, bytes)` (the store's
    atomic write), unless the file already holds them."""
    if counts.lines != len(records):
        raise ValueError(f"counts of {counts.lines} samples for an index of {len(records)}")
    if (Path(root) / FILE).is_dir():
        raise CorruptFile(f"{Path(root) / FILE} is a folder, not the set's token counts: move it away, then run "
                          "the command again")  # fmt: skip
    if counts.saved != counts.lines:
        counts.digest = digest_of(records)
        write(Path(root) / FILE, counts.to_bytes())
        counts.saved = counts.lines


def compose(parts: list[Counts], records: list) -> Counts:
    """The counts of sets joined whole, in order, as `records` (a merge that dropped no sample): sums,
    and first-seen order the first set's, then each next set's ids not seen before in its own order."""
    out = Counts()
    for p in parts:
        out.extend(p)
    if out.lines != len(records):
        raise ValueError(f"counts of {out.lines} samples for an index of {len(records)}")
    return out


class Keeper:
    """The counts a writing store keeps: each added sample's tokens, taken in once the index holds it,
    and the file, saved at most every `every_s` while committing (bounding what a resume after a kill
    reads back) and whenever the store asks (its manifest, its close)."""

    def __init__(self, root: Path, records: list, every_s: float = 60.0):
        self.root, self.every_s = Path(root), every_s
        self.counts = load(self.root, records)
        self.tokens: dict = {}  # key -> (ids, loss mask) of samples added and not yet counted
        self.saved_at = time.monotonic()

    def add(self, key: str, tokens) -> None:
        if tokens is not None:
            self.tokens[key] = tokens

    def committed(self, records: list, write) -> None:
        catch_up(self.counts, self.root, records, self.tokens)
        if time.monotonic() - self.saved_at > self.every_s:
            self.save(records, write)

    def save(self, records: list, write) -> None:
        catch_up(self.counts, self.root, records, self.tokens)
        save(self.root, self.counts, records, write)
        self.saved_at = time.monotonic()
