"""Hidden-state extraction for EAGLE-3 draft training: patched SGLang (or HF) -> zstd shards."""

__version__ = "0.1.0"
