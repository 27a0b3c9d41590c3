"""`python -m recipe.shards repair DIR`: the index made to agree with the shards' own bytes, without
computing a sample: what a resume does when it opens a set (`repair.py`, every record checked), for
a set that cannot be resumed (a merged one) or before a trainer reads it. Nothing the set committed
is cut; what is lost is named, for the run that made it to redo."""

from __future__ import annotations

from pathlib import Path

from ..errors import NotAShardSet
from . import tokencounts
from .store import (
    IDENTITY,
    MANIFEST,
    SHARD_DIR,
    ShardStore,
    atomic_write,
    atomic_write_json,
    left_bytes,
    read_manifest,
    summarize,  # fmt: skip
)


def mend(root: Path, deep: bool = True) -> tuple[list[str], bool]:
    """-> (what was done, one line each; whether samples are lost). The manifest's totals follow."""
    if not (root / SHARD_DIR).is_dir() or not ((root / IDENTITY).exists() or (root / MANIFEST).exists()):
        raise NotAShardSet(f"{root} is not a shard set (no {SHARD_DIR}/ beside identity.json or manifest.json)")
    with ShardStore(root, None, deep_check=deep) as store:
        recounted = deep and recount(store)
        manifest = read_manifest(root)
        if manifest is not None:
            fixed = {**summarize(store.records), "left": left_bytes(root, store.left),
                     "token_counts": store.counter.counts.summary()}  # fmt: skip
            if isinstance(manifest.get("counts"), dict) and not manifest["counts"].get("merged"):
                fixed["counts"] = recounted_ok(manifest["counts"], len(store.records))
            atomic_write_json(root / MANIFEST, {**manifest, **fixed})
        done = [f"{len(store.records)} samples indexed"]
        done += [f"re-indexed {sid} from its record ({why})" for sid, why in store.reindexed]
        if recounted:
            done.append(f"{tokencounts.FILE} did not hold the records' counts: counted again from the records")
        if store.recovered:
            done.append(f"indexed {len(store.recovered)} whole records the index had lost")
        done += [f"cut {n} bytes of a crashed run's append from {name}" for name, n in store.repaired]
        done += [f"left {name} as it is: {why}" for name, why in store.left]
        done += [f"lost {sid}: {why} (the command that made the set redoes it)" for sid, why in store.lost]
        return done, bool(store.lost)


def recounted_ok(counts: dict, ok: int) -> dict:
    """The run's counts with `ok` the samples the index now holds: those it lost are not done (the
    command that made the set redoes them), those it recovered are done."""
    c = {**counts, "ok": ok}
    c["not_done"] = counts.get("not_done", 0) + counts.get("ok", 0) - ok
    if c["not_done"] < 0:  # more recovered than the run had left to do: its input held them
        c["input"], c["not_done"] = c.get("input", 0) - c["not_done"], 0
    return c


def recount(store: ShardStore) -> bool:
    """The token counts counted again from every record; saved where they differ from what was kept
    (an edited file whose digest and totals still match). True: they differed."""
    fresh = tokencounts.catch_up(tokencounts.Counts(), store.root, store.records)
    if tokencounts.same(fresh, store.counter.counts):
        return False
    store.counter.counts = fresh
    store.counter.save(store.records, atomic_write)
    return True
