"""python -m recipe.shards COMMAND ...: read, check, mend and hand over a shard set.

inspect SET [--json]              what is in it: model, slots, codec, samples, tokens, bytes, counts, first samples
show SET ID                       one sample: its text with the loss-masked tokens marked, each slot's shape and norm
verify SET [--workers N]          every checksum, frame and count; exit 1 on any problem
repair SET [--fast]               the index made to agree with the shards (nothing committed is cut)
rebuild-index SET                 scan the shards without their index -> SET/index.rebuilt.jsonl
export --to specforge|speculators SET OUT [--gzip] [--overwrite] [--draft-vocab N] [--model-dir CKPT]
                                  the files a trainer reads
vocab-map SET --draft-vocab N     a draft vocabulary's d2t/t2d from the set's token counts
merge OUT SET [SET ...]           one set over several (one per job or node)
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import sys
from pathlib import Path

from ..errors import NotAShardSet, UserError, disk_full
from . import framing
from .codec import CorruptRecord
from .reader import ShardReader
from .store import SHARD_DIR, atomic_write, index_lines, summarize
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


def rebuild_index(root: Path, damaged: list | None = None) -> list[dict]:
    """Index records recovered from the shards alone, along their own framing (framing.py): each whole
    record's line read from itself. A record framed whole whose bytes do not decode, and bytes where
    no record starts, are named in `damaged` (where, why) and left out."""
    out = []
    for shard in sorted(f for f in (root / SHARD_DIR).glob("*.bin") if f.is_file() and not f.is_symlink()):
        with open(shard, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if os.fstat(f.fileno()).st_size else b""
        found: dict = {}
        stop = framing.walk(m, 0, found)
        for at, (length, _) in sorted(found.items()):
            try:
                out.append(framing.line_of(m, shard.name, at, length))
            except CorruptRecord as e:
                if damaged is not None:
                    damaged.append((f"{shard.name} @ {at}", str(e)))
        if stop < len(m) and damaged is not None:
            damaged.append((f"{shard.name} @ {stop}", f"{len(m) - stop} bytes that start no whole record"))
        if isinstance(m, mmap.mmap):
            m.close()
    return out


def main(argv=None) -> int:
    try:
        return command(argv)
    except UserError as e:  # the user's to fix: one line; anything else is a bug and keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what was committed stays; what was half-written is the command's own
        print("stopped: nothing committed was lost; run the same command again to finish it", file=sys.stderr)
        return 2
    except OSError as e:
        line = os_error_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2


def os_error_line(e: OSError) -> str | None:
    """The user's to fix, in one line: a full disk, a read-only or foreign folder. None: a bug."""
    full = disk_full(e)
    if full is not None:  # export and merge write gigabytes
        return f"disk full ({full}): free space there, then run the command again"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {e.filename or 'there'} ({e.strerror}): make it writable, or choose another folder"
    return None


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
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    ins = sub.add_parser("inspect", help="what is in a set (--json: every field)")
    ins.add_argument("--json", action="store_true", help="the full summary as JSON")
    ins.add_argument("dir", type=Path)
    sh = sub.add_parser("show", help="one sample: text with the loss mask marked, slot shapes and norms")
    sh.add_argument("dir", type=Path)
    sh.add_argument("id")
    v = sub.add_parser("verify", help="every checksum, frame and count; exit 1 on any problem")
    v.add_argument(
        "--workers", type=at_least_one, default=CORES,
        help="processes decoding records (default: the cores, at most 8); 1 decodes in this process",
    )  # fmt: skip
    v.add_argument("dir", type=Path)
    e = sub.add_parser("export", help="the files SpecForge or speculators reads")
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
    rp = sub.add_parser("repair", help="the index made to agree with the shards; what is lost is named")
    rp.add_argument(
        "--fast", action="store_true", help="check only what a plain resume checks (no crc32 of every record)"
    )
    rp.add_argument("dir", type=Path)
    sub.add_parser("rebuild-index", help="an index from the shards alone, beside the set's").add_argument(
        "dir", type=Path
    )
    vm = sub.add_parser("vocab-map", help="a draft vocabulary's d2t/t2d from the set's token counts")
    vm.add_argument("--draft-vocab", type=int, required=True, help="the draft's vocabulary size, e.g. 32000")
    vm.add_argument("--to", choices=["specforge", "speculators", "both"], default="both")
    vm.add_argument("--out", type=Path, help="where the files go (default: DIR/vocab/draft-N)")
    vm.add_argument("--target-vocab", type=int, help="default: the target checkpoint's config.json")
    vm.add_argument("dir", type=Path)
    mg = sub.add_parser("merge", help="one set over several (jobs, nodes)")
    mg.add_argument("out", type=Path)
    mg.add_argument("inputs", type=Path, nargs="+")
    return p


def command(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd != "merge" and not a.dir.is_dir():
        raise NotAShardSet(f"{a.dir} is not a folder")
    if a.cmd == "rebuild-index" and not (a.dir / SHARD_DIR).is_dir():
        raise NotAShardSet(f"{a.dir} has no {SHARD_DIR}/ folder: not a shard set")
    if a.cmd in ("inspect", "show"):
        from .summary import inspect_text, show_text

        text = (json.dumps(inspect(a.dir), indent=2) if a.json else inspect_text(a.dir)) if a.cmd == "inspect" else (
            show_text(a.dir, a.id))  # fmt: skip
        print(text)
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
        damaged: list = []
        recs = rebuild_index(a.dir, damaged)
        dest = a.dir / "index.rebuilt.jsonl"
        atomic_write(dest, index_lines(recs))  # a link at dest is replaced, never written through
        for where, why in damaged:
            print(f"  left out {where}: {why}")
        print(f"{len(recs)} samples found in the shards of {a.dir}: {dest} (compare with, or replace, index.jsonl)")
        return 0
    if a.cmd == "vocab-map":
        return vocab_map_command(a)
    return export_command(a) if a.cmd == "export" else merge_command(a)


def vocab_map_command(a: argparse.Namespace) -> int:
    from .vocabmap import default_dest, refuse_foreign, write

    dest = a.out or default_dest(a.dir, a.draft_vocab)
    refuse_foreign(dest, a.dir)
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
