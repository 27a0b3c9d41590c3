"""The input forms a user really has, beside one JSON/JSONL file (data.py reads those): a folder of
such files, Parquet, a local HF dataset (one split of a DatasetDict), and compressed files that were
cut short. Each yields (where, record); what cannot be read is one line that names it.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import zstandard

from .errors import UserError

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".gz", ".xz", ".zst", ".parquet")  # a folder's files that are read
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # datasets.save_to_disk's own files


class SourceError(UserError, RuntimeError):
    pass


def is_hf_dataset(path: Path) -> bool:
    return any((path / m).exists() for m in HF_MARKERS)


def folder_files(path: Path) -> list[Path]:
    """A folder's data files, in name order (the order a resume and a job split rely on)."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FILE_SUFFIXES)
    if not files:
        raise SourceError(f"{path} holds no data file ({', '.join(FILE_SUFFIXES)}) and is no saved HF dataset")
    return files


def hf_rows(path: Path, name: str, split: str):
    """A local HF dataset (datasets.save_to_disk): its rows, or the named split's of a DatasetDict."""
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{path} is a saved HF dataset: reading it needs `pip install datasets`") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise SourceError(f"{path} has no split {split!r} (it has {sorted(ds)}): pass data.split=NAME")
        others = sorted(set(ds) - {split})
        if others:
            log.info("%s: reading split %r; left out %s (data.split=NAME reads another)", path, split, others)
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"{name}:{i}", row


def parquet_rows(path: Path, name: str):
    """A Parquet file's rows, a batch at a time (a large file never held whole)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{path} is Parquet: reading it needs `pip install pyarrow`") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own errors: not Parquet, or cut short
        raise SourceError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    i = 0
    for batch in f.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{name}:{i}", row
            i += 1


def cut_short(path: Path, e: BaseException, n: int) -> SourceError:
    return SourceError(
        f"{path} is cut short or damaged after {n} lines ({type(e).__name__}: {e}): "
        "copy it again whole, or decompress what it holds and pass that"
    )


class ZstdWhole(io.RawIOBase):
    """A .zst file's content, frame after frame, raising EOFError where the file ends inside a frame
    (zstd's stream reader ends there quietly, which would read a cut file as a shorter one)."""

    def __init__(self, path: Path):
        self.f, self.d, self.buf = open(path, "rb"), zstandard.ZstdDecompressor().decompressobj(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.buf:
            chunk = self.f.read(1 << 20)
            if not chunk:
                if not self.d.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while chunk:
                if self.d.eof:  # the next of concatenated frames
                    self.d = zstandard.ZstdDecompressor().decompressobj()
                self.buf += self.d.decompress(chunk)
                chunk = self.d.unused_data if self.d.eof else b""
        n = min(len(b), len(self.buf))
        b[:n], self.buf = self.buf[:n], self.buf[n:]
        return n

    def close(self) -> None:
        self.f.close()
        super().close()
