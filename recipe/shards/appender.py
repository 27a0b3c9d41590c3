"""A store that writes frames itself, one shard file at a time: how tests and benchmarks build a set
without the packer. Production never uses it: there, packer workers own the shard files (taken with
`ShardStore.take_shard`) and the packer records their frames with `ShardStore.add`."""

from __future__ import annotations

import os

from .codec import crc32
from .store import SHARD_DIR, ShardStore, shard_names


class AppendingStore(ShardStore):
    _shard = None  # its own shard, opened by the first append()

    def _open_shard(self) -> None:
        """Continue the newest shard while it has room; never reopen older ones."""
        names = shard_names(self.root, self.records)
        newest = self.root / SHARD_DIR / names[-1] if names else None
        ok = newest is not None and newest.exists() and newest.name not in {n for n, _ in self.left}
        self._shard_path = newest if ok and newest.stat().st_size < self.max_shard_bytes else self.new_shard_path()
        self._shard = open(self._shard_path, "ab")
        self._shard_size = self._shard.tell()

    def append(self, sample_id: str, key: str, frame: bytes, tokens: int, raw_bytes: int, **extra) -> None:
        """Write a frame to its own shard and record it (committed by commit())."""
        if self._shard is None:
            self._open_shard()
        if self._shard_size and self._shard_size + len(frame) > self.max_shard_bytes:
            self.commit()
            self._shard.close()
            self._shard_path = self.new_shard_path()
            self._shard = open(self._shard_path, "ab")
            self._shard_size = 0
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
