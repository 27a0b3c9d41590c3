"""What a shard set is (its identity) and how it was made (provenance), kept apart from the flow.

The identity is every input that changes the bytes of a sample: model weights, capture spec,
tokenizer and chat template, data sources, length policy and job split. It is written before the
first sample and a resume must match it field for field. Anything else (workers, concurrency,
zstd level, shard size, server flags such as TP size, data.limit) may change between runs: the
stored samples stay the same samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

from omegaconf import OmegaConf

from . import __version__
from .data import file_sha256
from .regenerate import settings as regen_settings
from .shards.codec import SET_FORMAT


def model_fingerprint(model_dir: Path) -> str:
    """config.json + every weight file's name, size and first MiB (its safetensors header):
    cheap on a 1 TB checkpoint, and changes with any re-export."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{file_sha256(f, 1 << 20)}".encode())
    return h.hexdigest()[:32]


def tokenizer_provenance(model_dir: Path, tokenizer) -> dict:
    """Hashes of the tokenizer files, the chat template and any remote code (*.py) beside them."""
    files = {
        p.name: file_sha256(p)
        for p in sorted(model_dir.iterdir())
        if p.is_file()
        and (
            p.name.startswith(("tokeniz", "special_tokens", "chat_template"))
            or p.suffix in (".model", ".tiktoken", ".jinja")
        )
    }
    code = {p.name: file_sha256(p) for p in sorted(model_dir.glob("*.py"))}
    return {
        "sha256": files.get("tokenizer.json"),
        "files": files,
        "remote_code": code or None,
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
    }


def capture_spec(cfg) -> dict:
    layers = list(cfg.capture.layers)
    return {
        "layers": layers,
        "final": bool(cfg.capture.final),
        "final_norm": "post" if cfg.capture.final else None,
        "convention": cfg.capture.convention,
        "slots": slot_names(layers, cfg.capture.final),
        "dtype": cfg.model.dtype,
    }


def slot_names(layers, final) -> list[str]:
    return [f"layer_{i}" for i in layers] + (["final_post_norm"] if final else [])


def identity(cfg, fingerprint: str, tokenizer: dict, sources: list[dict]) -> dict:
    return {
        "format": f"recipe-hidden-states/{SET_FORMAT}",
        "model_fingerprint": fingerprint,
        "capture": capture_spec(cfg),
        "tokenizer": tokenizer,
        # only when not the default: sets written before this field existed keep their identity
        **({"codec": codec_name(cfg.shards.codec)} if cfg.shards.codec != "lossless" else {}),
        "data": {
            "sources": [{"source": s["source"], "sha256": s["sha256"]} for s in sources],
            "max_length": cfg.data.max_length,
            "overflow": cfg.data.overflow.value,
            "shard_index": cfg.data.shard_index,
            "num_shards": cfg.data.num_shards,
            **({"split": cfg.data.split} if cfg.data.split != "train" else {}),  # only when set, as below
            # only when set: shard sets written before this field existed keep their identity
            **(
                {"chat_template_kwargs": OmegaConf.to_container(cfg.data.chat_template_kwargs, resolve=True)}
                if cfg.data.chat_template_kwargs
                else {}
            ),
            # only when on: a set of the answers as given keeps its identity, and never mixes with these
            **({"regenerate": regen_settings(cfg.data.regenerate)} if cfg.data.regenerate.turns != "off" else {}),
        },
    }


def codec_name(kind: str) -> str:
    """What a set's records hold, as the identity and the manifest name it: `lossless` (bf16 as it
    is), or the fp8 codec's versioned name."""
    from .shards import fp8

    return fp8.NAME if kind == "fp8" else "lossless"


def versions() -> dict:
    import importlib.metadata as md

    out = {"recipe": __version__, "python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "sglang", "zstandard", "hydra-core"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def backend_provenance(cfg) -> dict:
    out = {"name": cfg.backend.name}
    if cfg.backend.name == "sglang":
        from . import patch

        out["patch"] = patch.installed_status()
        out["server_args"] = OmegaConf.to_container(cfg.server.args, resolve=True)
        out["nccl"] = cfg.nccl.name
    return out
