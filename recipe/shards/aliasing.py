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


def holds_a_set(path: Path) -> bool:
    """A folder with any file of a shard set in it."""
    return any((path / name).exists() for name in (INDEX, MANIFEST, IDENTITY, SHARD_DIR))
