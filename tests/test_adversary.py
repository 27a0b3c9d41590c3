"""A finished set damaged at random (seeded: flipped bytes, truncations, deletions, appended bytes,
index and manifest edits, symbolic links), then every command run on it. After each seed:
- no command ends in a traceback: each refusal is a UserError (one line at the CLI);
- no command that reads every record (export, verify) succeeds over a set that does not verify;
- every record whose bytes the damage did not touch is still served, bit for bit, after a resume
  whose input holds almost none of them (nothing committed and undamaged is lost);
- a resume whose input holds them all then leaves a set that verifies, with every sample (those it
  redid computed anew: another batch gives other bf16 roundings, so only the untouched are compared).

`python -m pytest -q -m slow tests/test_adversary.py` runs 200 seeds; the fast group runs 16.
"""

import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import small_run_cfg as cfg

from recipe.errors import UserError
from recipe.main import run
from recipe.shards import ShardReader
from recipe.shards.__main__ import main as shards_cli
from recipe.shards.codec import crc32
from recipe.shards.verify import verify

N = 8
EXTRA = ("shards.max_shard_gb=0.0003", "shards.commit_every=1", "shards.workers=1", "shards.deep_check=true")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pristine")
    run(cfg(tmp, *EXTRA, limit=N))
    out = tmp / "out"
    r = ShardReader(out)
    frames = {x["id"]: (x["shard"], x["offset"], bytes(r.read_frame(x))) for x in r.records}
    values = {i: served(r, i) for i in r.ids}
    return out, frames, values


def served(r: ShardReader, sid: str) -> tuple:
    return tuple(a.tobytes() for a in r.get_numpy(sid)[1].values())


def damage(out: Path, rng: random.Random) -> str:
    """One damage, chosen and placed by rng; returns what it did."""
    shards = sorted((out / "shards").glob("shard-*.bin"))
    idx = out / "index.jsonl"
    lines = idx.read_text().splitlines() if idx.exists() else []
    kind = rng.choice(["flip", "truncate", "delete_shard", "append", "index_gone", "index_cut", "line_gone",
                       "line_twice", "line_edit", "line_garbage", "manifest", "identity_gone", "next",
                       "swap_shards"])  # fmt: skip
    s = rng.choice(shards) if shards else None
    if kind == "flip" and s and s.stat().st_size:
        b = bytearray(s.read_bytes())
        at = rng.randrange(len(b))
        b[at] ^= 1 << rng.randrange(8)
        s.write_bytes(bytes(b))
        return f"flip {s.name}@{at}"
    if kind == "truncate" and s:
        at = rng.randrange(s.stat().st_size + 1)
        with open(s, "r+b") as f:
            f.truncate(at)
        return f"truncate {s.name} to {at}"
    if kind == "delete_shard" and s:
        s.unlink()
        return f"delete {s.name}"
    if kind == "append" and s:
        with open(s, "ab") as f:
            f.write(rng.randbytes(rng.randrange(1, 3000)))
        return f"append to {s.name}"
    if kind == "index_gone" and idx.exists():
        idx.unlink()
        return "delete index"
    if kind == "index_cut" and lines:
        at = rng.randrange(len(idx.read_bytes()))
        idx.write_bytes(idx.read_bytes()[:at])
        return f"cut index at {at}"
    if kind in ("line_gone", "line_twice", "line_edit", "line_garbage") and lines:
        return damage_line(idx, lines, kind, rng)
    if kind == "manifest" and (out / "manifest.json").exists():
        m = out / "manifest.json"
        m.write_text(rng.choice(["{}", "{", "[]", m.read_text().replace('"layers": [', '"layers": [9, ')]))
        return "edit manifest"
    if kind == "identity_gone" and (out / "identity.json").exists():
        (out / "identity.json").unlink()
        return "delete identity"
    if kind == "next":
        (out / "shards" / "NEXT").write_text(rng.choice(["x", "", "-5", "3"]))
        return "NEXT garbage"
    if kind == "swap_shards" and len(shards) > 1:
        a, b = rng.sample(shards, 2)
        a.rename(a.with_name("tmp"))
        b.rename(a)
        a.with_name("tmp").rename(b)
        return f"swap {a.name} {b.name}"
    return "nothing"


def damage_line(idx: Path, lines: list[str], kind: str, rng: random.Random) -> str:
    """One index line gone, doubled, made garbage, or one of its fields edited."""
    i = rng.randrange(len(lines))
    if kind == "line_gone":
        del lines[i]
    elif kind == "line_twice":
        lines.insert(rng.randrange(len(lines) + 1), lines[i])
    elif kind == "line_garbage":
        lines[i] = rng.choice(["{}", "1", "[", '{"id": 3}', "null"])
    else:
        rec = json.loads(lines[i])
        field = rng.choice(["id", "key", "shard", "offset", "length", "tokens", "crc32", "raw_bytes"])
        rec[field] = rng.choice([0, 7, -1, "x", None, json.loads(rng.choice(lines)).get(field)])
        lines[i] = json.dumps(rec)
    idx.write_text("".join(x + "\n" for x in lines))
    return f"{kind} {i}"


def vouched(out: Path, frames: dict) -> set:
    """Samples no readable index line vouches for: every line naming it gives another crc32. The line
    committed the record, so either it or the record changed since: a resume redoes the sample rather
    than serve either unproven."""
    idx = out / "index.jsonl"
    crcs: dict = {}
    for line in idx.read_text(errors="replace").splitlines() if idx.exists() else []:
        try:
            rec = json.loads(line)
            crcs.setdefault(rec["id"], set()).add(rec["crc32"])
        except (ValueError, TypeError, KeyError):
            continue
    return {sid for sid, seen in crcs.items() if sid in frames and crc32(frames[sid][2]) not in seen}


def intact(out: Path, frames: dict) -> set:
    """Samples whose record bytes still lie where they were written, and whose index lines (if any
    name them) still vouch for those bytes."""
    keep = set()
    for sid, (shard, at, frame) in frames.items():
        p = out / "shards" / shard
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                f.seek(at)
                if f.read(len(frame)) == frame:
                    keep.add(sid)
    return keep - vouched(out, frames)


def every_command(out: Path, tmp: Path) -> None:
    """Each command either refuses in one line (exit 2) or succeeds; one that reads every record
    succeeds only over a set that verifies."""
    problems = verify(out)
    code = shards_cli(["export", "--to", "specforge", str(out), str(tmp / "export")])
    assert code in (0, 2)
    if code == 0:
        assert problems == [], problems
    shutil.rmtree(tmp / "export", ignore_errors=True)
    assert shards_cli(["inspect", str(out)]) in (0, 2)
    try:
        r = ShardReader(out)
        for sid in r.ids:
            r.get(sid)
    except UserError:
        return
    assert problems == [], problems  # every record read back: verify must agree


def one_seed(pristine, tmp_path, seed: int) -> None:
    src, frames, values = pristine
    out = tmp_path / "out"
    shutil.copytree(src, out)
    rng = random.Random(seed)
    did = [damage(out, rng) for _ in range(rng.randint(1, 3))]
    whole = intact(out, frames)
    every_command(out, tmp_path)
    try:
        run(cfg(tmp_path, *EXTRA, limit=1))  # an input that holds one sample of the set
    except UserError:
        assert intact(out, frames) >= whole, did  # refused: nothing it could have touched is gone
        return
    r = ShardReader(out)
    assert all(served(r, sid) == values[sid] for sid in whole if sid in r.by_id), did
    assert whole <= set(r.ids), (did, whole - set(r.ids))
    try:
        run(cfg(tmp_path, *EXTRA, limit=N))
    except UserError:
        assert intact(out, frames) >= whole, did
        return
    assert verify(out) == [], did
    r = ShardReader(out)  # every sample, those never damaged as they were (a redone one is computed anew)
    assert sorted(r.ids) == sorted(values) and all(served(r, i) == values[i] for i in whole), did


@pytest.mark.parametrize("seed", range(16))
def test_a_randomly_damaged_set_loses_nothing_undamaged_and_never_crashes(pristine, tmp_path, seed):
    one_seed(pristine, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16, 216))
def test_two_hundred_more_random_damages(pristine, tmp_path, seed):
    one_seed(pristine, tmp_path, seed)
