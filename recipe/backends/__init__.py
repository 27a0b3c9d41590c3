"""Backends compute the hidden states. `make_backend` picks one by `backend.name` from REGISTRY:

    with make_backend(cfg, model_dir, dump_dir, output_dir) as backend:
        backend.run(samples, packer, should_stop)

`run` announces every sample to the sink (the packer: `expect`, under the rid `capture.rid_prefix` +
sample id), has its states written into the dump directory (the server's hook, or the HF backend
through the same capture writer), and tells the sink when each response arrived (`responded`) or
failed (`fail`, `forget` for a superseded attempt); leaving the block releases the model or stops
the server.

A registry rather than `_target_` nodes: the set is closed (each backend needs its own code path in
the hook and the tests), the name is what users type (`backend=sglang`), and the table below says in
one place which config nodes each backend is handed, which a `_target_` cannot.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from omegaconf import OmegaConf


class Sink(Protocol):
    """What a backend reports to (recipe.packer.Packer)."""

    progress: Any  # .start(): the capture begins (model loaded, server ready)

    def expect(self, rid: str, sample) -> None: ...

    def responded(self, rid: str) -> None: ...

    def fail(self, rid: str, reason: str) -> None: ...

    def forget(self, rid: str) -> None: ...


class Backend(Protocol):
    @classmethod
    def from_config(cls, model_dir: Path, dump_dir: Path, output_dir: Path, **nodes) -> "Backend": ...

    def run(self, samples: Iterable, sink: Sink, should_stop: Callable[[], bool]) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Backend": ...

    def __exit__(self, *exc) -> None: ...


# backend.name -> (class, the top-level config nodes it is handed)
REGISTRY = {
    "hf": ("recipe.backends.hf:HFBackend", ("backend", "capture", "model")),
    "sglang": ("recipe.backends.sglang:SGLangBackend", ("server", "client", "capture", "nccl")),
}


def make_backend(cfg, model_dir: Path, dump_dir: Path, output_dir: Path) -> Backend:
    """The backend named by backend.name, handed only the config nodes REGISTRY lists for it."""
    target, nodes = REGISTRY[cfg.backend.name]
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    # typed sections (recipe/schema.py dataclasses, interpolations resolved): a component reads its
    # own settings as plain attributes, never the config tree
    return cls.from_config(model_dir, dump_dir, output_dir, **{n: OmegaConf.to_object(cfg[n]) for n in nodes})
