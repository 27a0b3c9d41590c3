"""python -m recipe.shards {inspect,verify,export,merge} ...

inspect DIR                       summary: counts, sizes, ratio, provenance
verify DIR [--workers N]          every checksum, frame and count; exit 1 on any problem
export --to specforge|speculators DIR OUT [--gzip] [--overwrite] [--model-dir CKPT] [--workers N]
merge OUT IN [IN ...]             one index + manifest over several shard sets
repair DIR [--fast]               the index made to agree with the shards (nothing committed is cut)
rebuild-index DIR                 scan the shards without their index -> DIR/index.rebuilt.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import zstandard

from ..errors import NotAShardSet, UserError, disk_full
from .codec import crc32, decode, tail_frame_follows
from .reader import ShardReader
from .store import SHARD_DIR, index_lines, summarize
from .verify import verify


def inspect(root: Path) -> dict:
    r = ShardReader(root)
    m = r.manifest
    t = summarize(r.records)["totals"]  # the index's own figures, not the manifest's copy of them
    info = {
        "dir": str(root),
        "format": m.get("format"),
        "model": (m.get("model") or {}).get("name"),
        "capture": r.slots,
        "convention": m["capture"].get("convention"),
        "samples": len(r),
        "tokens": t["tokens"],
        "stored_gb": round(t["stored_bytes"] / 1e9, 4),
        "raw_gb": round(t["raw_bytes"] / 1e9, 4),
        "ratio": round(t["raw_bytes"] / t["stored_bytes"], 4) if t["stored_bytes"] else None,
        "shards": len({x["shard"] for x in r.records}),
        "counts": m.get("counts"),
        "codec": m.get("codec"),
        "versions": m.get("versions"),
        "patch": (m.get("backend") or {}).get("patch"),
    }
    return info


def scan_shard(path: Path):
    """Yields (offset, frame bytes) for each zstd frame in a shard, in order, without the index:
    frames are self-delimiting. Stops at a truncated tail."""
    with open(path, "rb") as f:
        offset, pending = 0, b""
        while True:
            dobj, frame = zstandard.ZstdDecompressor().decompressobj(), []
            data = pending or f.read(1 << 20)
            while data:
                dobj.decompress(data)
                if dobj.eof:
                    used = len(data) - len(dobj.unused_data)
                    frame.append(data[:used])
                    pending = dobj.unused_data
                    break
                frame.append(data)
                data = f.read(1 << 20)
            if not dobj.eof:
                return  # end of file (or a torn last frame)
            raw = b"".join(frame)
            yield offset, raw
            offset += len(raw)
            if not pending:
                pending = f.read(1 << 20)
                if not pending:
                    return


def rebuild_index(root: Path) -> list[dict]:
    """Index records recovered from the shards alone (docs/FORMAT.md: frames carry their meta)."""
    out = []
    for shard in sorted((root / SHARD_DIR).glob("*.bin")):
        frames = scan_shard(shard)
        for offset, frame in frames:
            if tail_frame_follows(frame):  # a v2 record: its low plane is the next (raw) frame
                nxt = next(frames, None)
                if nxt is None:
                    break  # a torn last record
                frame += nxt[1]
            meta, arrs = decode(frame)
            ids, mask, hid = arrs["input_ids"], arrs["loss_mask"], arrs["hidden"]
            out.append(
                {
                    "id": meta["id"],
                    "key": meta["key"],
                    "shard": shard.name,
                    "offset": offset,
                    "length": len(frame),
                    "tokens": int(ids.shape[0]),
                    "raw_bytes": int(ids.nbytes + hid.nbytes + mask.nbytes),
                    "crc32": crc32(frame),
                    "loss_tokens": int(np.asarray(mask).sum()),
                    "source": meta.get("source"),
                }
            )
    return out


def main(argv=None) -> int:
    try:
        return command(argv)
    except UserError as e:  # the user's to fix: one line; anything else is a bug and keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # export and merge write gigabytes: a full disk is the user's to free
        full = disk_full(e)
        if full is None:
            raise
        print(f"error: disk full ({full}): free space there, then run the command again", file=sys.stderr)
        return 2


CORES = min(8, os.cpu_count() or 1)  # the default of every --workers


def at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: at least 1")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipe.shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect").add_argument("dir", type=Path)
    v = sub.add_parser("verify")
    v.add_argument(
        "--workers", type=at_least_one, default=CORES,
        help="processes decoding records (default: the cores, at most 8); 1 decodes in this process",
    )  # fmt: skip
    v.add_argument("dir", type=Path)
    e = sub.add_parser("export")
    e.add_argument("--to", required=True, choices=["specforge", "speculators"])
    e.add_argument(
        "--final-norm",
        choices=["pre-norm-equivalent", "refuse", "keep-post-norm"],
        default="pre-norm-equivalent",
        help="speculators: its trainer applies the verifier norm to the last slot, so it must be "
        "pre-norm; ours is post-norm and is stored as post/w (w = the final-norm weight)",
    )
    e.add_argument("--model-dir", type=Path, help="the target checkpoint (default: the manifest's model.path)")
    e.add_argument("--gzip", action="store_true", help="specforge: data_i.ckpt.gz (its loader reads both)")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (stale files removed)")
    e.add_argument("--draft-vocab", type=int, help="also the trainer's d2t/t2d for a draft of this many ids")
    e.add_argument("--target-vocab", type=int, help="with --draft-vocab; default: the target's config.json")
    e.add_argument(
        "--workers", type=at_least_one, default=CORES,
        help="processes writing files (default: the cores, at most 8); 1 writes in this process",
    )  # fmt: skip
    e.add_argument("dir", type=Path)
    e.add_argument("out", type=Path)
    rp = sub.add_parser("repair")
    rp.add_argument(
        "--fast", action="store_true", help="check only what a plain resume checks (no crc32 of every record)"
    )
    rp.add_argument("dir", type=Path)
    sub.add_parser("rebuild-index").add_argument("dir", type=Path)
    vm = sub.add_parser("vocab-map", help="a draft vocabulary's d2t/t2d from the set's token counts")
    vm.add_argument("--draft-vocab", type=int, required=True, help="the draft's vocabulary size, e.g. 32000")
    vm.add_argument("--to", choices=["specforge", "speculators", "both"], default="both")
    vm.add_argument("--out", type=Path, help="where the files go (default: DIR/vocab/draft-N)")
    vm.add_argument("--target-vocab", type=int, help="default: the target checkpoint's config.json")
    vm.add_argument("dir", type=Path)
    mg = sub.add_parser("merge")
    mg.add_argument("out", type=Path)
    mg.add_argument("inputs", type=Path, nargs="+")
    return p


def command(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd != "merge" and not a.dir.is_dir():
        raise NotAShardSet(f"{a.dir} is not a folder")
    if a.cmd == "rebuild-index" and not (a.dir / SHARD_DIR).is_dir():
        raise NotAShardSet(f"{a.dir} has no {SHARD_DIR}/ folder: not a shard set")
    if a.cmd == "inspect":
        print(json.dumps(inspect(a.dir), indent=2))
        return 0
    if a.cmd == "verify":
        problems = verify(a.dir, workers=a.workers)
        for x in problems:
            print("  " + x)
        return 1 if problems else 0
    if a.cmd == "repair":
        from .mend import mend

        done, lost = mend(a.dir, deep=not a.fast)
        print("\n".join(f"repair: {x}" for x in done))
        return 1 if lost else 0
    if a.cmd == "rebuild-index":
        recs = rebuild_index(a.dir)
        dest = a.dir / "index.rebuilt.jsonl"
        dest.write_bytes(index_lines(recs))
        print(f"{len(recs)} samples found in the shards of {a.dir}: {dest} (compare with, or replace, index.jsonl)")
        return 0
    if a.cmd == "vocab-map":
        return vocab_map_command(a)
    return export_command(a) if a.cmd == "export" else merge_command(a)


def vocab_map_command(a: argparse.Namespace) -> int:
    from .vocabmap import default_dest, refuse_foreign, write

    dest = a.out or default_dest(a.dir, a.draft_vocab)
    refuse_foreign(dest)
    forms = ("specforge", "speculators") if a.to == "both" else (a.to,)
    info = write(a.dir, dest, a.draft_vocab, forms, a.target_vocab)
    print(f"a draft vocabulary of {a.draft_vocab} over {info['target_vocab_size']} target ids, from the loss-masked "
          f"tokens of {info['samples']} samples, in {dest}:")  # fmt: skip
    if "specforge" in info:
        print(f"  SpecForge: model.vocab_mapping_path: {dest / 'vocab_mapping.pt'}  (draft_vocab_size: {a.draft_vocab};"
              f" top-{a.draft_vocab} coverage {info['specforge']['coverage']:.2%})")  # fmt: skip
    if "speculators" in info:
        print(f"  speculators: --draft-vocab-size {a.draft_vocab} --d2t-path {dest / 'd2t.npy'} "
              f"--t2d-path {dest / 't2d.npy'}  (token_freq.pt beside them)")  # fmt: skip
    return 0


def export_command(a: argparse.Namespace) -> int:
    from .export import ExportError, export

    try:
        info = export(a.to, a.dir, a.out, final_norm=a.final_norm, model_dir=a.model_dir, compress=a.gzip,
                      overwrite=a.overwrite, workers=a.workers, draft_vocab=a.draft_vocab,
                      target_vocab=a.target_vocab)  # fmt: skip
    except ExportError as e:
        print(f"export refused: {e}", file=sys.stderr)
        return 2
    n = info["samples_total"]
    print(f"exported {n} samples to {a.out} ({a.to}); samples.jsonl maps each file to its sample id")
    print("draft config values these files need (also in export_info.json):")
    print(json.dumps(info["draft_config"], indent=2))
    return 0


def merge_command(a: argparse.Namespace) -> int:
    from .merge import MergeError, merge

    try:
        print(json.dumps(merge(a.out, a.inputs), indent=2))
    except MergeError as e:
        print(f"merge refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
