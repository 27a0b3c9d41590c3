"""`python -m recipe.shards repair DIR`: the index made to agree with the shards' own bytes, without
computing a sample: what a resume does when it opens a set (`repair.py`, every record checked), for
a set that cannot be resumed (a merged one) or before a trainer reads it. Nothing the set committed
is cut; what is lost is named, for the run that made it to redo."""

from __future__ import annotations

from pathlib import Path

from ..errors import NotAShardSet
from .store import (
    IDENTITY,
    MANIFEST,
    SHARD_DIR,
    ShardStore,
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
        manifest = read_manifest(root)
        if manifest is not None:
            fixed = {**summarize(store.records), "left": left_bytes(root, store.left),
                     "token_counts": store.counter.counts.summary()}  # fmt: skip
            atomic_write_json(root / MANIFEST, {**manifest, **fixed})
        done = [f"{len(store.records)} samples indexed"]
        done += [f"re-indexed {sid} from its record ({why})" for sid, why in store.reindexed]
        if store.recovered:
            done.append(f"indexed {len(store.recovered)} whole records the index had lost")
        done += [f"cut {n} bytes of a crashed run's append from {name}" for name, n in store.repaired]
        done += [f"left {name} as it is: {why}" for name, why in store.left]
        done += [f"lost {sid}: {why} (the command that made the set redoes it)" for sid, why in store.lost]
        return done, bool(store.lost)
