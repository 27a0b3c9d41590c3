"""An output never aliases an input: export and merge write where no input lies, so that replacing
or filling their output can never delete, truncate or overwrite a set the user owns."""

from __future__ import annotations

import os
from pathlib import Path

from .store import IDENTITY, INDEX, MANIFEST, SHARD_DIR


def alias(out: Path, src: Path) -> str | None:
    """How `out` aliases the input `src` (the same folder, through a link or not; a folder inside
    it; a folder that holds it), or None."""
    o, s = Path(os.path.realpath(out)), Path(os.path.realpath(src))
    if o == s or (out.exists() and src.exists() and os.path.samefile(out, src)):
        return f"{out} is the input {src} itself"
    if s in o.parents:
        return f"{out} lies inside the input {src}"
    if o in s.parents:
        return f"{out} holds the input {src}"
    return None


def refuse_alias(out: Path, inputs, error) -> None:
    """Raise `error` (one line) where `out` aliases any of `inputs`."""
    for src in inputs:
        why = alias(Path(out), Path(src))
        if why is not None:
            raise error(f"{why}: writing there would destroy it; choose an output folder apart from every input")


SET_FILES = (INDEX, MANIFEST, IDENTITY, SHARD_DIR)


def holds_a_set(path: Path) -> bool:
    """A folder with any file of a shard set in it."""
    return any((path / name).exists() for name in SET_FILES)


def set_within(path: Path) -> Path | None:
    """A shard set at `path` or anywhere under it (a Hydra `outputs/` folder holding a run, say), or
    None. Links are not followed: what lies behind one is not deleted with the folder."""
    if holds_a_set(path):
        return path
    for top, dirs, _ in os.walk(path):
        for d in dirs:
            if holds_a_set(Path(top) / d):
                return Path(top) / d
    return None


def set_around(path: Path) -> Path | None:
    """The shard set that `path` (its links resolved) lies inside, as its `shards/` folder or deeper; or None."""
    real = Path(os.path.realpath(path))
    return next((p for p in real.parents if is_a_set(p)), None)


def is_a_set(path: Path) -> bool:
    """A shard set's own folder: its shards/ beside an index, a manifest or an identity."""
    return (path / SHARD_DIR).is_dir() and any((path / n).is_file() for n in (INDEX, MANIFEST, IDENTITY))
