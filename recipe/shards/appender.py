"""A store that writes frames itself, one shard file at a time: how tests and benchmarks build a set
without the packer. Production never uses it: there, packer workers own the shard files (taken with
`ShardStore.take_shard`) and the packer records their frames with `ShardStore.add`."""

from __future__ import annotations

import os

from .codec import crc32
from .store import ShardStore, owned_file


class AppendingStore(ShardStore):
    _shard = None  # its own shard, opened by the first append()

    def _use(self, path, size: int) -> None:
        self._shard_path, self._shard_size = path, size
        self._shard = owned_file(path, "ab")

    def append(self, sample_id: str, key: str, frame: bytes, tokens: int, raw_bytes: int, **extra) -> None:
        """Write a frame to its own shard (taken as a packer worker takes one) and record it
        (committed by commit())."""
        if self._shard is None:
            self._use(*self.take_shard())
        if self._shard_size and self._shard_size + len(frame) > self.max_shard_bytes:
            self.commit()
            self._shard.close()
            self._use(self.new_shard_path(), 0)
        self._check_new(sample_id, key)
        self._shard.write(frame)
        name, at = self._shard_path.name, self._shard_size
        self.add(sample_id, key, name, at, len(frame), crc32(frame), tokens, raw_bytes, **extra)
        self._shard_size += len(frame)

    def _fsync_shards(self, names: set[str]) -> None:
        if self._shard is not None:
            self._shard.flush()
            if self._shard_path.name in names:
                os.fsync(self._shard.fileno())
                names = names - {self._shard_path.name}
        super()._fsync_shards(names)

    def close(self) -> None:
        super().close()
        if self._shard is not None:
            self._shard.close()
