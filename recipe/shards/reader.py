"""Reading shards: random access by sample id, iteration, and a torch Dataset.

Shard files are mapped lazily per process, so a DataLoader with num_workers > 0 (fork or spawn)
gets its own mappings in every worker.
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from pathlib import Path

import numpy as np

from ..errors import CorruptFile, NotAShardSet
from .codec import CorruptRecord, Recycler, decode
from .store import INDEX, MANIFEST, SHARD_DIR, read_identity, read_index, read_manifest

STEPWISE_FROM = 256 << 20  # records this long (bytes stored) are decoded in steps, their pages let go


def to_torch(arr: np.ndarray, dtype: str):
    import torch

    if not arr.flags.writeable:
        arr = arr.copy()
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def check_record(line: dict, meta: dict, tokens: int, slots=None) -> None:
    """A record is the one its index line names: its own id, key and token count (`tokens`: its
    input_ids' length; a checksum only says the bytes are intact, not that the line points at the
    right record), holding the slots the manifest names (its own list is the authority)."""
    if slots is not None and "slots" in meta and list(meta["slots"]) != list(slots):
        raise CorruptRecord(f"the record holds slots {meta['slots']}, the manifest names {list(slots)}")
    if meta.get("id") != line["id"]:
        raise CorruptRecord(f"the index line says id {line['id']}, the record holds {meta.get('id')}")
    if "key" in meta and "key" in line and meta["key"] != line["key"]:
        raise CorruptRecord(f"the index line says key {line['key']}, the record holds {meta['key']}")
    if "tokens" in line and tokens != line["tokens"]:
        raise CorruptRecord(f"the index line says {line['tokens']} tokens, the record holds {tokens}")


MANIFEST_FIX = "the run that made the set, resumed with its settings (python -m recipe ... output_dir=...), rewrites it"


def manifest_needs(root: Path, m: dict, part: str, keys) -> None:
    """A CorruptFile naming what the manifest lacks of what a command reads (never a KeyError)."""
    if not isinstance(m.get(part), dict) or any(k not in m[part] for k in keys):
        fix = MANIFEST_FIX
        raise CorruptFile(f"{root / MANIFEST} lacks {part}.{'/'.join(keys)}: it is damaged; {fix}")


def manifest_slots(root: Path, m: dict) -> list[str] | None:
    """The slots the manifest names (None: it names none), checked against identity.json (the
    record written first)."""
    manifest_needs(root, m, "capture", ())
    ident = read_identity(root)
    if ident is not None and isinstance(ident.get("capture"), dict) and ident["capture"] != m["capture"]:
        fix = MANIFEST_FIX
        raise CorruptFile(f"{root / MANIFEST}: its capture disagrees with identity.json's (edited?); {fix}")
    slots = m["capture"].get("slots")
    return list(slots) if isinstance(slots, list) else None


def refuse_a_lost_index(root: Path, records: list, m: dict) -> None:
    """An index shorter than the manifest's count, or none beside shards that hold bytes: its lines
    were lost, and a reader would serve part of the set as if it were all of it."""
    said = (m.get("totals") or {}).get("samples", 0) if isinstance(m.get("totals"), dict) else 0
    shards = root / SHARD_DIR
    if len(records) < said or (not records and any(f.stat().st_size for f in shards.glob("shard-*.bin"))):
        raise CorruptFile(
            f"{root / INDEX} lists {len(records)} samples, the manifest {said}: the index lost lines "
            f"(`python -m recipe.shards repair {root}` rebuilds it from the shards)"
        )


class ShardReader:
    """index=False: the manifest and the shards without the index (a worker handed its records)."""

    def __init__(self, root: str | Path, refuse_duplicates: bool = True, index: bool = True):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        if self.manifest is None:
            raise NotAShardSet(
                f"{self.root} has no manifest.json: not a finished shard directory"
                + ("" if self.root.is_dir() else " (it does not exist)")
            )
        self.slots = manifest_slots(self.root, self.manifest)
        self.records = read_index(self.root) if index else []
        if index:
            refuse_a_lost_index(self.root, self.records, self.manifest)
        self.by_id = {r["id"]: r for r in self.records}
        if refuse_duplicates and len(self.by_id) != len(self.records):
            dup = [i for i, n in Counter(r["id"] for r in self.records).items() if n > 1]
            raise CorruptRecord(
                f"{self.root / 'index.jsonl'}: duplicate id {dup[0]} ({len(dup)} sample(s) listed more than "
                f"once), which would be served twice; `python -m recipe.shards verify {self.root}` names "
                "every problem"
            )
        self._maps: dict[str, mmap.mmap] = {}
        self._pid = None
        self._recycler = Recycler()  # decode memory, back once nothing uses it (threads never share it)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def ids(self) -> list[str]:
        return [r["id"] for r in self.records]

    @property
    def codec(self) -> str:
        """What the records hold: `lossless` bf16, or `fp8-e4m3` (read back as bf16 all the same)."""
        return str((self.manifest.get("codec") or {}).get("name", "lossless"))

    def _map(self, shard: str, end: int) -> mmap.mmap | None:
        """The shard file mapped read-only, covering byte `end` if the file does (None if not)."""
        if self._pid != os.getpid():  # forked into a worker: its own mappings
            self._maps, self._pid = {}, os.getpid()
        m = self._maps.get(shard)
        if m is None or len(m) < end:  # first use, or the file grew since it was mapped
            path = self.root / SHARD_DIR / shard
            if not path.is_file():
                return None
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < end:
                    return None
                m = self._maps[shard] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        return m

    def read_frame(self, rec: dict) -> memoryview:
        """The record's bytes, straight out of the page cache: a view of the mapped shard, no copy
        (a pread into fresh memory cost 51 ms per 89 MB on the GPU host; into a reused buffer
        still 15 ms of a 141 ms get). Shards of a finished directory are never rewritten in place:
        a file cut short under a live reader would fault, one cut before is reported here."""
        end = rec["offset"] + rec["length"]
        m = self._map(rec["shard"], end)
        if m is None:
            missing = not (self.root / SHARD_DIR / rec["shard"]).is_file()
            raise CorruptRecord(f"sample {rec['id']}: {rec['shard']} is {'missing' if missing else 'truncated'}")
        return memoryview(m)[rec["offset"] : end]

    def let_go(self, shard: str) -> None:
        """Drops this process's pages of a shard it has read (the page cache keeps them): a pass over
        a terabyte holds the pages of what it reads now, not of everything it has read."""
        m = self._maps.get(shard) if self._pid == os.getpid() else None
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)

    def _release(self, rec: dict):
        """For a record of gigabytes: lets decode drop the mapped pages it has passed, so a read
        holds its output, not the shard's pages as well (they stay in the page cache)."""
        if rec["length"] < STEPWISE_FROM or not hasattr(mmap, "MADV_DONTNEED"):
            return None
        m, base, page = self._maps[rec["shard"]], rec["offset"], mmap.PAGESIZE

        def release(a: int, b: int) -> None:
            lo, hi = -(-(base + a) // page) * page, (base + b) // page * page  # whole pages inside
            if hi > lo:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

        return release

    def get_numpy(self, sample_id: str) -> tuple[dict, dict[str, np.ndarray]]:
        rec = self.by_id[sample_id]
        try:
            frame = self.read_frame(rec)
            meta, arrs = decode(frame, rec["crc32"], self._recycler, self._release(rec))
            check_record(rec, meta, len(arrs["input_ids"]), self.slots)
            return meta, arrs
        except CorruptRecord as e:
            raise CorruptRecord(f"sample {sample_id} in {rec['shard']} @ {rec['offset']}: {e}") from None

    def get(self, sample_id: str) -> dict:
        """{'input_ids', 'loss_mask', 'hidden' [T, slots, H], 'meta'} as torch tensors."""
        meta, arrs = self.get_numpy(sample_id)
        dtypes = meta.get("dtypes", {})
        out = {k: to_torch(v, dtypes.get(k, "")) for k, v in arrs.items()}
        out["meta"] = meta
        return out

    def __iter__(self):
        for r in self.records:
            yield self.get(r["id"])

    def __getstate__(self):  # picklable into spawn workers: no mappings, no buffers
        d = dict(self.__dict__)
        d["_maps"], d["_pid"] = {}, None
        del d["_recycler"]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._recycler = Recycler()

    def close(self):
        self._maps = {}  # unmapped once the last frame viewing them is gone


class HiddenStatesDataset:
    """A map-style dataset over one shard directory (index order) for torch's DataLoader. Defined at
    module level and holding no open handles when pickled, so spawn/forkserver workers get it."""

    def __init__(self, root: str | Path):
        self.reader = ShardReader(root)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> dict:
        return self.reader.get(self.reader.records[i]["id"])
