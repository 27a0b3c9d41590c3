"""Whether a whole record that no index line names was written by this set, before a resume or a
repair indexes it from itself. A shard file copied in from another set or another model is whole and
well framed, so its framing proves nothing: its records' own header must match the set's identity.
- slots: the layers (and final state) the set captures;
- codec: lossless bf16 planes, or fp8 codes and scales;
- key: sample_key(model fingerprint, capture, the record's token ids), which is what the set's own run
  stores; another model, other layers or other token ids (another tokenizer) give another key.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .codec import CorruptRecord, record_tokens
from .fp8 import CODE

Foreign = Callable[[bytes, dict], "str | None"]  # (the record's bytes, its header) -> why it is not the set's


def _codec_of(header: dict) -> str:
    names = {t.get("name") for t in header.get("tensors") or ()}
    return "fp8" if CODE in names else "lossless"


def judge(identity: dict | None) -> Foreign | None:
    """The check for a set of this identity (identity.json, or the manifest's copy); None where the
    set records none (a set from before identity.json: nothing to compare with)."""
    if not isinstance(identity, dict) or not isinstance(identity.get("capture"), dict):
        return None
    capture, fingerprint = identity["capture"], identity.get("model_fingerprint")
    codec = "fp8" if str(identity.get("codec", "lossless")).startswith("fp8") else "lossless"

    def foreign(record: bytes, header: dict) -> str | None:
        from ..data import sample_key

        meta = header.get("meta") or {}
        if capture.get("slots") is not None and meta.get("slots") != capture["slots"]:
            return f"it holds slots {meta.get('slots')}, the set captures {capture['slots']}"
        if _codec_of(header) != codec:
            return f"its codec is {_codec_of(header)}, the set's is {codec}"
        if fingerprint is None:
            return None
        try:
            ids, _ = record_tokens(record)
        except CorruptRecord as e:
            return str(e)
        if sample_key(fingerprint, capture, ids) != meta.get("key"):
            return "its key is not the one this set's model, layers and tokenizer give its token ids"
        return None

    return foreign


def of_set(root: Path) -> Foreign | None:
    """judge() for the set at root, from identity.json or the manifest's copy of it."""
    from .store import read_identity, read_manifest

    try:
        ident = read_identity(root)
        if ident is None:
            ident = (read_manifest(root) or {}).get("identity")
    except ValueError:  # damaged: the set's own open names it; nothing is indexed from an unknown identity
        return lambda record, header: "the set's identity cannot be read"
    return judge(ident)
