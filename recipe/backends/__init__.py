"""Backends compute the hidden states. Each one is a context manager chosen by `backend.name`:

    with make_backend(...) as backend:        # recipe.main.make_backend
        backend.run(samples, packer, writer, rid_of, should_stop)

`run` announces every sample to the packer (`expect`), has its states written through the capture
writer into the dump directory, and tells the packer when each response arrived (`responded`) or
failed (`fail`); leaving the block releases the model or stops the server.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol


class Backend(Protocol):
    def run(self, samples: Iterable, packer, writer, rid_of: Callable, should_stop: Callable[[], bool]) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Backend": ...

    def __exit__(self, *exc) -> None: ...
