"""A set's token counts stay exact, recounted here from the stored samples after each way a set changes:
a run, a resume with a narrower or wider data.limit, kill -9, the repair of a damaged shard, a merge of
job outputs (with and without duplicates), and a counts file gone, damaged or from another set."""

import collections
import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, compose

from recipe.main import run
from recipe.shards import ShardReader, tokencounts
from recipe.shards.merge import merge


def recount(root) -> tuple[list, dict]:
    """From the samples the index lists, in its order: loss-masked counts as a Counter fills (first
    seen first, ascending ids within a sample) and every token's count."""
    r = ShardReader(root)
    loss, every = collections.Counter(), collections.Counter()
    for sid in r.ids:
        x = r.get(sid)
        ids, mask = x["input_ids"].numpy(), x["loss_mask"].numpy()
        loss.update(dict(zip(*(a.tolist() for a in np.unique(ids[mask == 1], return_counts=True)))))
        every.update(dict(zip(*(a.tolist() for a in np.unique(ids, return_counts=True)))))
    return list(loss.items()), dict(every)


def stored(root) -> tuple[list, dict]:
    """What token_counts.npz holds, checked to describe exactly the index beside it."""
    c = tokencounts.Counts.from_file(root / tokencounts.FILE)
    assert tokencounts.covers(c, ShardReader(root).records) and c.lines == len(ShardReader(root).records)
    ids, freq = c.counter()
    return list(zip(ids.tolist(), freq.tolist())), {int(i): int(c.all[i]) for i in np.flatnonzero(c.all)}


def assert_exact(root) -> None:
    assert stored(root) == recount(root)
    assert json.loads((root / "manifest.json").read_text())["token_counts"]["samples"] == len(ShardReader(root).ids)


def cfg(tmp_path, *extra, limit=8, out="out"):
    return compose([f"output_dir={tmp_path / out}", f"capture.dump_dir={tmp_path / 'shm'}", f"data.limit={limit}",
                    "log_every_s=1000", *extra])  # fmt: skip


def test_counts_are_exact_after_a_run_and_a_narrower_then_a_wider_resume(tmp_path):
    run(cfg(tmp_path, limit=8))
    assert_exact(tmp_path / "out")
    run(cfg(tmp_path, limit=4))  # nothing new: the set keeps its 8
    assert_exact(tmp_path / "out")
    run(cfg(tmp_path, limit=14))
    assert_exact(tmp_path / "out")
    assert len(ShardReader(tmp_path / "out").ids) == 14


@pytest.mark.timeout(300)
def test_counts_are_exact_after_kill_9_and_the_resume(tmp_path):
    """A first run leaves counts for 6 samples; a wider one is killed while it commits (its counts
    file still holds the 6); the resume brings the counts up to the index from the records."""
    run(cfg(tmp_path, limit=6))
    before = (tmp_path / "out" / tokencounts.FILE).read_bytes()
    argv = [sys.executable, "-m", "recipe", f"output_dir={tmp_path / 'out'}", f"capture.dump_dir={tmp_path / 'shm'}",
            "data.limit=40", "shards.commit_every=1", "log_every_s=1000", "backend.batch_size=1"]  # fmt: skip
    p = subprocess.Popen(argv, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    index = tmp_path / "out" / "index.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and index.read_bytes().count(b"\n") < 12:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (tmp_path / "out" / tokencounts.FILE).read_bytes() == before  # the kill left the 6-sample counts
    assert 12 <= index.read_bytes().count(b"\n") < 40
    counts = tokencounts.load(tmp_path / "out", ShardReader(tmp_path / "out").records)  # as vocab-map reads it
    ids, freq = counts.counter()
    assert (
        counts.lines == len(ShardReader(tmp_path / "out").ids)
        and list(zip(ids.tolist(), freq.tolist())) == recount(tmp_path / "out")[0]
    )
    run(cfg(tmp_path, limit=40))
    assert_exact(tmp_path / "out")


def test_counts_are_exact_after_a_damaged_shard_is_repaired(tmp_path):
    run(cfg(tmp_path, limit=10))
    out = tmp_path / "out"
    rec = ShardReader(out).records[3]
    shard = out / "shards" / rec["shard"]
    data = bytearray(shard.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0xFF  # one sample's bytes damaged
    shard.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "recipe.shards", "repair", str(out)], capture_output=True, text=True,
                       cwd=ROOT)  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    assert rec["id"] not in ShardReader(out).ids
    c = tokencounts.Counts.from_file(out / tokencounts.FILE)
    assert c.lines == 9 and tokencounts.covers(c, ShardReader(out).records)
    run(cfg(tmp_path, limit=10))  # the resume redoes the damaged sample
    assert_exact(out)


@pytest.mark.parametrize("duplicate", [False, True])
def test_counts_are_exact_after_a_merge_of_job_outputs(tmp_path, duplicate):
    for i in range(2):
        run(cfg(tmp_path, "data.num_shards=2", f"data.shard_index={i}", limit=12, out=f"job{i}"))
    inputs = [tmp_path / "job0", tmp_path / "job1"]
    if duplicate:  # the same job twice: every sample of the copy dropped as a duplicate
        shutil.copytree(tmp_path / "job1", tmp_path / "again")
        inputs.append(tmp_path / "again")
    merge(tmp_path / "merged", inputs)
    assert_exact(tmp_path / "merged")


@pytest.mark.parametrize("how", ["deleted", "damaged", "another set's"])
def test_a_counts_file_that_is_gone_damaged_or_foreign_is_counted_again(tmp_path, how):
    run(cfg(tmp_path, limit=6))
    run(cfg(tmp_path, limit=3, out="other"))
    f = tmp_path / "out" / tokencounts.FILE
    if how == "deleted":
        f.unlink()
    elif how == "damaged":
        f.write_bytes(f.read_bytes()[:100])
    else:
        shutil.copy(tmp_path / "other" / tokencounts.FILE, f)
    run(cfg(tmp_path, limit=6))
    assert_exact(tmp_path / "out")


def test_counts_read_a_records_tokens_without_its_hidden_states(tmp_path):
    """What catching up costs per sample: the record's first bytes (frame A's header, ids and mask)."""
    from recipe.shards.codec import record_tokens

    run(cfg(tmp_path, limit=4))
    r = ShardReader(tmp_path / "out")
    for rec in r.records:
        with open(tmp_path / "out" / "shards" / rec["shard"], "rb") as f:
            f.seek(rec["offset"])
            ids, mask = record_tokens(f)
        x = r.get(rec["id"])
        assert np.array_equal(ids, x["input_ids"].numpy()) and np.array_equal(mask, x["loss_mask"].numpy())


@pytest.mark.parametrize("top", [60, 201_088])  # and ids past 65,535, as int32 as records hold them: growth mid-call
def test_samples_counted_at_once_rank_and_sum_as_a_counter_filled_one_by_one(top):
    """verify counts a range of samples in one call: the counts and the first-seen order are a Counter's
    filled sample by sample (ascending ids within one), empty and unmasked samples included."""
    rng = np.random.default_rng(0)
    pool = np.r_[np.arange(40), rng.integers(40, top, 20)].astype(np.int32)  # a few ids far up, repeated
    samples = [(rng.choice(pool, n), rng.integers(0, 2, n)) for n in rng.integers(0, 30, 40)]
    samples[3] = samples[25] = ((), ())  # one inside a call, one opening it
    loss, every = collections.Counter(), collections.Counter()
    for ids, mask in samples:
        ids, mask = np.asarray(ids, np.int64), np.asarray(mask)
        loss.update(dict(zip(*(a.tolist() for a in np.unique(ids[mask == 1], return_counts=True)))))
        every.update(ids.tolist())
    c = tokencounts.Counts()
    c.add_many(samples[:25])
    c.add_many(samples[25:])
    ids, freq = c.counter()
    assert list(zip(ids.tolist(), freq.tolist())) == list(loss.items())
    assert {int(i): int(c.all[i]) for i in np.flatnonzero(c.all)} == dict(every) and c.lines == len(samples)
    with pytest.raises(ValueError, match="differ in length"):  # a short mask beside a long one: no shifted counts
        c.add_many([(np.arange(3), np.ones(2)), (np.arange(2), np.ones(3))])
    assert c.lines == len(samples)
