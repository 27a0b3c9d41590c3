"""The one line between the user's mistakes and the recipe's bugs.

A `UserError` is the user's to fix (input, configuration, a model folder, an output or dump folder
that is damaged, foreign or not writable): every entry point (`python -m recipe`, `recipe.shards`,
`recipe.serve`, `recipe.patch`) prints its message as one line and exits 2. Anything else is a bug
and keeps its traceback. Each error class names its kind; a second base (ValueError, OSError, ...)
keeps `except` clauses written for the builtin working.
"""

from __future__ import annotations

import errno


class UserError(Exception):
    pass


class NotAShardSet(UserError, FileNotFoundError):
    """A folder that is not a finished shard set (no manifest.json) or does not exist."""


class CorruptFile(UserError, ValueError):
    """A file the recipe owns (index, NEXT, identity.json, manifest) that cannot be read."""


class ModelDirError(UserError, FileNotFoundError):
    """model.path names nothing the recipe can load."""


class OutputDirError(UserError, ValueError):
    """output_dir or the dump folder cannot be used."""


class DiskFull(UserError, OSError):
    """A full disk (ENOSPC), met anywhere in a run: the output's filesystem or the dump folder's RAM
    disk. What is durable stays and the same command resumes the rest. The packer raises its own as
    this type; `recipe.main.run` is the one place that handles it."""


def disk_full(e: BaseException | None) -> DiskFull | None:
    """The full disk behind an error (the error itself, or its cause or context), as a DiskFull."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e if isinstance(e, DiskFull) else DiskFull(e.errno, e.strerror, e.filename)
        e = e.__cause__ or e.__context__
    return None
