"""Integrity: a shard set never mixes runs, never loses a sample silently, and bad input or a broken
output directory is a clear message, never a traceback or a silent success.

Each test breaks something the way a user or a machine would (kill -9, a changed config, a deleted
shard, a second run on the same RAM disk) and then checks the three things that matter: nothing
mixed, nothing lost silently, and `verify` agrees with the index.
"""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_run_cfg as cfg

from recipe.main import run
from recipe.shards import HiddenStatesDataset, ShardReader
from recipe.shards.appender import AppendingStore
from recipe.shards.store import ProvenanceMismatch
from recipe.shards.verify import verify


def recipe_cli(tmp, *args, env=None, wait=True, out=None, prefix=()):
    """`python -m recipe` in a subprocess, writing under tmp (out/, shm/, <out>-run/); `prefix`
    runs it under another command (unshare)."""
    out = out or tmp / "out"
    p = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "recipe",
            f"output_dir={out}",
            f"capture.dump_dir={tmp / 'shm'}",
            f"hydra.run.dir={out}-run",
            "log_every_s=1000",
            *args,
        ],
        cwd=tmp,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    if wait:
        log, _ = p.communicate(timeout=300)
        return p.returncode, log
    return p


def index_bytes(tmp):
    return (tmp / "out" / "index.jsonl").read_bytes()


def exactly_once(out, n):
    r = ShardReader(out)
    assert len(r.ids) == len(set(r.ids)) == n
    assert verify(out) == []


# --- a resume that would mix configurations is refused, before and after a manifest exists ----


def changed_template_model(tmp):
    from recipe.models import materialize

    src = materialize("tiny-llama")
    dst = tmp / "tiny-other-template"
    shutil.copytree(src, dst)
    jinja = dst / "chat_template.jinja"  # where transformers 5 saves it
    if jinja.exists():
        jinja.write_text(jinja.read_text() + "{# a changed template #}")
    else:
        tc = json.loads((dst / "tokenizer_config.json").read_text())
        tc["chat_template"] += "{# a changed template #}"
        (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst


def other_weights_model(tmp):
    """The same architecture, one weight changed: another model to the fingerprint."""
    from safetensors.torch import load_file, save_file

    from recipe.models import materialize

    dst = tmp / "tiny-other-weights"
    shutil.copytree(materialize("tiny-llama"), dst)
    w = load_file(dst / "model.safetensors")
    w["lm_head.weight"][0, 0] += 1
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("change", ["layers", "max_length", "template", "data_file", "model", "job_split"])
def test_a_resume_with_another_configuration_is_refused_even_without_a_manifest(tmp_path, change):
    data = tmp_path / "d.jsonl"
    shutil.copy(__import__("recipe.data", fromlist=["ASSETS"]).ASSETS / "tiny-chat.jsonl", data)
    base = ["capture.layers=[1,3]", f"data.sources=[{data}]"]
    run(cfg(tmp_path, *base))
    (tmp_path / "out" / "manifest.json").unlink()  # as after a kill -9 before the first manifest
    before = index_bytes(tmp_path)
    extra = {
        "layers": ["capture.layers=[1,2]"],
        "max_length": ["data.max_length=64"],
        "template": [f"model.path={changed_template_model(tmp_path)}"],
        "job_split": ["data.num_shards=2"],
        "model": [f"model.path={other_weights_model(tmp_path)}"],
    }.get(change, [])
    if change == "data_file":
        data.write_text(data.read_text().replace("a", "b", 1))
    with pytest.raises(ProvenanceMismatch, match="another configuration") as e:
        run(cfg(tmp_path, *base, *extra))
    key = {
        "layers": "capture.layers",
        "max_length": "data.max_length",
        "template": "chat_template_sha256",
        "data_file": "data.sources",
        "model": "model_fingerprint",
        "job_split": "data.num_shards",
    }[change]
    assert key in str(e.value) and "output_dir=" in str(e.value)
    assert index_bytes(tmp_path) == before  # nothing written


def test_changes_that_keep_the_samples_the_same_may_resume(tmp_path):
    run(cfg(tmp_path, limit=6))
    counts = run(
        cfg(
            tmp_path,
            "shards.workers=1",
            "shards.zstd_level=3",
            "shards.max_shard_gb=1",
            "backend.batch_size=2",
            limit=9,
        )
    )
    assert counts["already_stored"] == 6 and counts["ok_this_run"] == 3
    exactly_once(tmp_path / "out", 9)


@pytest.mark.slow
def test_kill_9_in_the_first_run_then_another_config_is_refused_with_one_message(tmp_path):
    p = recipe_cli(
        tmp_path, "capture.layers=[1,3]", "data.limit=40", "backend.batch_size=1", "shards.commit_every=1", wait=False
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not ((tmp_path / "out" / "index.jsonl").exists() and index_bytes(tmp_path)):
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "out" / "manifest.json").exists(), "the kill must land before the manifest"
    before = index_bytes(tmp_path)
    rc, out = recipe_cli(tmp_path, "capture.layers=[1,2]", "data.limit=40")
    assert rc != 0 and "capture.layers: on disk [1, 3], this run [1, 2]" in out
    assert "Traceback" not in out
    assert index_bytes(tmp_path) == before
    rc, out = recipe_cli(tmp_path, "capture.layers=[1,3]", "data.limit=40")  # the same config resumes
    assert rc == 0, out
    exactly_once(tmp_path / "out", 40)


# --- lost and duplicated samples ------------------------------------------------------------


def test_a_deleted_or_truncated_shard_is_named_by_verify_and_redone_by_resume(tmp_path):
    run(cfg(tmp_path, "shards.max_shard_gb=0.00002", "shards.commit_every=1", "shards.workers=1"))  # ~20 KB
    out = tmp_path / "out"
    r = ShardReader(out)
    shards = sorted({x["shard"] for x in r.records})
    assert len(shards) >= 4  # one packer worker: only the rollover makes several
    gone = [x["id"] for x in r.records if x["shard"] == shards[1]]
    cut = [x["id"] for x in r.records if x["shard"] == shards[2]]
    (out / "shards" / shards[1]).unlink()
    with open(out / "shards" / shards[2], "r+b") as f:
        f.truncate(10)
    res = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(out)], capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    assert f"{shards[1]} is missing: {len(gone)} samples lost" in res.stdout and all(i in res.stdout for i in gone)
    assert f"{shards[2]} is cut short" in res.stdout and all(i in res.stdout for i in cut)
    counts = run(cfg(tmp_path, "shards.max_shard_gb=0.00002", "shards.commit_every=1", "shards.workers=1"))
    assert counts["ok_this_run"] == len(gone) + len(cut) and counts["ok"] == 8
    exactly_once(out, 8)
    new = {x["shard"] for x in ShardReader(out).records} - set(shards)
    assert new and all(n > shards[-1] for n in new)  # never a reused name


def test_a_sample_id_is_stored_at_most_once(tmp_path):
    run(cfg(tmp_path, limit=3))
    out = tmp_path / "out"
    lines = (out / "index.jsonl").read_bytes().splitlines(keepends=True)
    (out / "index.jsonl").write_bytes(b"".join(lines) + lines[0])
    problems = verify(out)
    assert any("duplicate id" in p for p in problems)
    (out / "index.jsonl").write_bytes(b"".join(lines))
    store = AppendingStore(out, json.loads((out / "identity.json").read_text()))
    rec = store.records[0]
    with pytest.raises(ValueError, match="already stored"):
        store.append(rec["id"], "another-key", b"x", 1, 1)
    store.close()


def test_readers_and_exports_refuse_an_index_that_lists_a_sample_twice(tmp_path):
    """Two index files joined with cat: every read path refuses, naming the sample, rather than
    serving it twice; verify still lists every problem."""
    from recipe.shards.codec import CorruptRecord
    from recipe.shards.export import export
    from recipe.shards.trainers import SpecForgeDataset, SpeculatorsDataset

    run(cfg(tmp_path, limit=3))
    out = tmp_path / "out"
    lines = (out / "index.jsonl").read_bytes().splitlines(keepends=True)
    (out / "index.jsonl").write_bytes(b"".join(lines) + lines[1])
    dup = json.loads(lines[1])["id"]
    readers = [ShardReader, HiddenStatesDataset, SpecForgeDataset, SpeculatorsDataset]
    for read in [*readers, lambda o: export("specforge", o, tmp_path / "sf")]:
        with pytest.raises(CorruptRecord, match=f"duplicate id {dup}"):
            read(out)
    assert not (tmp_path / "sf").exists()
    assert f"duplicate id {dup} in index" in verify(out)


def test_a_reader_refuses_an_index_line_that_points_at_another_samples_record(tmp_path):
    """An index line whose place (shard, offset, length, crc) is another sample's: the checksum
    holds, so only the record's own id tells; get() and verify name the sample."""
    from recipe.shards.codec import CorruptRecord

    run(cfg(tmp_path, limit=3))
    out = tmp_path / "out"
    a, b, c = (json.loads(x) for x in (out / "index.jsonl").read_text().splitlines())
    place = ("shard", "offset", "length", "crc32")
    a.update({k: b[k] for k in place})
    (out / "index.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (a, b, c)))
    r = ShardReader(out)
    with pytest.raises(
        CorruptRecord, match=f"sample {a['id']} .*the index line says id {a['id']}, the record holds {b['id']}"
    ):
        r.get(a["id"])
    assert r.get(c["id"])["input_ids"].shape[0] == c["tokens"]
    assert any(p.startswith(f"sample {a['id']}") and "the index line says id" in p for p in verify(out))


@pytest.mark.parametrize("name", ["shards/NEXT", "identity.json", "manifest.json"])
def test_a_damaged_file_the_recipe_owns_is_one_line_naming_the_file_and_the_fix(tmp_path, name):
    """Garbage in a small file of the set: the resume (and verify, for identity.json) say which file
    and what to do, as a user error, not a dead packer thread or a bare JSON error."""
    from recipe.errors import CorruptFile

    run(cfg(tmp_path, limit=3))
    out = tmp_path / "out"
    (out / name).write_text("garbage{")
    said = f"{out / name} is damaged .*; "
    if name == "manifest.json":  # readers refuse it; the resume rewrites it from the index
        with pytest.raises(CorruptFile, match=said):
            ShardReader(out)
        assert run(cfg(tmp_path, limit=3))["ok"] == 3
        assert len(ShardReader(out)) == 3
        return
    with pytest.raises(CorruptFile, match=said):
        run(cfg(tmp_path, "shards.max_shard_gb=0.00001", limit=5))  # a new shard file: NEXT is read
    if name == "identity.json":
        assert any(f"{out / name} is damaged" in p for p in verify(out))


# --- resume trusts nothing it has not checked --------------------------------------------------


def several_shards(tmp_path, n=8):
    extra = ("shards.max_shard_gb=0.00002", "shards.commit_every=1", "shards.workers=1")  # ~20 KB each
    run(cfg(tmp_path, *extra, limit=n))
    return tmp_path / "out", lambda *more: run(cfg(tmp_path, *extra, *more, limit=n))


def test_a_resume_repairs_a_line_listed_twice(tmp_path):
    out, resume = several_shards(tmp_path)
    lines = (out / "index.jsonl").read_bytes().splitlines(keepends=True)
    (out / "index.jsonl").write_bytes(b"".join(lines) + lines[2])
    counts = resume()
    assert counts["ok"] == 8 and counts["ok_this_run"] == 0
    exactly_once(out, 8)


def test_swapped_or_renamed_shards_are_never_cut_and_their_samples_are_indexed_from_their_records(tmp_path):
    """Two shard files that swap names, and one renamed to a fresh name: the index no longer
    describes them. The resume drops their lines, indexes each record again where it now lies (none
    is redone), cuts none of their bytes, and the set then reads and verifies whole."""
    out, resume = several_shards(tmp_path)
    r = ShardReader(out)
    shards = sorted({x["shard"] for x in r.records})
    assert len(shards) >= 4
    d = out / "shards"
    a, b, c = d / shards[0], d / shards[1], d / shards[2]
    sizes = {p.name: p.stat().st_size for p in (a, b, c)}
    a.rename(d / "tmp")
    b.rename(a)
    (d / "tmp").rename(b)
    c.rename(d / "shard-00777.bin")
    counts = resume()
    assert counts["ok"] == 8 and counts["ok_this_run"] == 0
    assert (a.stat().st_size, b.stat().st_size) == (sizes[b.name], sizes[a.name])  # not a byte cut
    assert (d / "shard-00777.bin").stat().st_size == sizes[c.name]
    exactly_once(out, 8)
    for x in ShardReader(out).records:
        ShardReader(out).get(x["id"])


def test_a_resume_drops_lines_whose_place_holds_another_sample(tmp_path):
    """Two index lines that swapped places (shard, offset, length, crc): each checksum holds, only the
    records' own ids tell. The resume reads them, drops what it cannot trust, redoes it."""
    out, resume = several_shards(tmp_path)
    lines = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    place = ("shard", "offset", "length", "crc32")
    a, b = ({k: x[k] for k in place} for x in lines[:2])
    lines[0].update(b)
    lines[1].update(a)
    (out / "index.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert resume()["ok"] == 8
    exactly_once(out, 8)
    r = ShardReader(out)
    assert all(r.get(i)["meta"]["id"] == i for i in r.ids)


def flip_a_byte(out, rec):
    path = out / "shards" / rec["shard"]
    data = bytearray(path.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_over_several_processes_names_what_one_process_names(tmp_path, monkeypatch):
    """A terabyte set is verified over several processes: the ranges of the index they split it into
    cover every record once, so they name the same damaged samples, in index order."""
    from recipe.shards import verify as verifying

    out, _ = several_shards(tmp_path)
    recs = ShardReader(out).records
    for i in (0, 4, 7):  # the first record, one in the middle, the last: each in another range
        flip_a_byte(out, recs[i])
    monkeypatch.setattr(verifying, "RANGE_RECORDS", 3)  # [0, 3), [3, 6), [6, 8)
    one, many = verify(out, workers=1), verify(out, workers=3)
    assert many == one
    assert [next(r["id"] for r in recs if r["id"] in p) for p in one] == [recs[i]["id"] for i in (0, 4, 7)]


def test_a_long_verify_says_how_far_it_is_with_its_rate_and_eta(tmp_path, monkeypatch):
    from recipe.shards import verify as verifying

    out, _ = several_shards(tmp_path)
    monkeypatch.setattr(verifying, "RANGE_RECORDS", 2)
    monkeypatch.setattr(verifying, "PROGRESS_EVERY_S", 0.0)
    log = io.StringIO()
    assert verify(out, log=log) == []
    lines = log.getvalue().splitlines()
    line = re.compile(
        r"verify: (\d+)/8 samples, \S+ \S+ of \S+ \S+ raw, \S+ \S+/s \| 0 problem\(s\) so far \| ETA \S+ s"
    )
    assert all(line.fullmatch(x) for x in lines), lines
    assert [int(line.fullmatch(x)[1]) for x in lines] == [2, 4, 6]  # after the last range: the verdict line


def test_verify_lets_go_of_the_pages_of_every_shard_it_has_read(tmp_path, monkeypatch):
    """Verifying a terabyte holds the pages of the records it reads now, not of every shard read
    (mapped pages count in a process's and a container's memory until let go)."""
    out, _ = several_shards(tmp_path)
    let_go = []
    monkeypatch.setattr(ShardReader, "let_go", lambda self, shard: let_go.append(shard))
    assert verify(out) == []
    assert sorted(set(let_go)) == sorted({r["shard"] for r in ShardReader(out).records})


def test_verify_refuses_fewer_than_one_worker_in_one_line(tmp_path, capsys):
    from recipe.shards.__main__ import main

    out, _ = several_shards(tmp_path, n=2)
    with pytest.raises(SystemExit) as e:
        main(["verify", "--workers", "0", str(out)])
    assert e.value.code == 2 and "--workers: 0: at least 1" in capsys.readouterr().err


def test_a_flipped_byte_is_found_by_a_deep_resume_and_redone(tmp_path):
    out, resume = several_shards(tmp_path)
    rec = ShardReader(out).records[3]
    flip_a_byte(out, rec)
    assert any(rec["id"] in p for p in verify(out))
    counts = resume("shards.deep_check=true")
    assert counts["ok_this_run"] == 1 and counts["ok"] == 8
    exactly_once(out, 8)


def test_an_index_line_whose_crc32_was_edited_never_vouches_for_its_record(tmp_path):
    """The record is whole (its own checks pass) but its line now gives another crc32: the line or the
    record changed since the commit, and which one cannot be told, so a deep resume redoes the sample."""
    out, resume = several_shards(tmp_path)
    lines = (out / "index.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    lines[3] = json.dumps({**rec, "crc32": rec["crc32"] ^ 1})
    (out / "index.jsonl").write_text("\n".join(lines) + "\n")
    assert any(rec["id"] in p for p in verify(out))
    counts = resume("shards.deep_check=true")
    assert counts["ok_this_run"] == 1 and counts["ok"] == 8
    exactly_once(out, 8)


def test_a_narrower_resume_keeps_the_whole_set_in_the_manifest(tmp_path):
    run(cfg(tmp_path, limit=5))
    counts = run(cfg(tmp_path, limit=2))
    assert counts["input"] == counts["ok"] == 2
    assert counts["stored_total"] == 5 and counts["stored_outside_this_input"] == 3
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["totals"]["samples"] == 5 and m["counts"]["stored_total"] == 5
    assert verify(tmp_path / "out") == []


@pytest.mark.parametrize("setting", ["data.max_length=600", "+data.chat_template_kwargs.enable_thinking=false"])
def test_merge_refuses_sets_whose_samples_differ_as_resume_would(tmp_path, setting):
    """Merge checks what resume checks: two truncation policies or template settings never mix."""
    from recipe.shards.merge import MergeError, merge

    run(cfg(tmp_path / "a", limit=2))
    run(cfg(tmp_path / "b", setting, limit=2))
    with pytest.raises(MergeError, match=setting.split("=")[0].split(".")[-1]) as e:
        merge(tmp_path / "m", [tmp_path / "a" / "out", tmp_path / "b" / "out"])
    assert "this run" not in str(e.value) and f"{tmp_path / 'b' / 'out'}:" in str(e.value)  # each set named


def test_a_users_own_run_folder_beside_the_dumps_is_left_alone(tmp_path):
    """Abandoned dump folders are looked for only in this user's own `user-<uid>` folder: a `run-*`
    folder of the user's in a custom capture.dump_dir is not the recipe's to remove."""
    mine = tmp_path / "shm" / "run-mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    run(cfg(tmp_path, limit=2))
    assert (mine / "notes.txt").read_text() == "keep"


def test_merge_keeps_each_sample_id_once(tmp_path):
    from recipe.shards.merge import merge

    run(cfg(tmp_path, limit=4))
    info = merge(tmp_path / "m", [tmp_path / "out", tmp_path / "out"])
    assert info["samples"] == 4 and info["duplicates"] == 4
    assert verify(tmp_path / "m") == []


# --- the Dataset in DataLoader workers ------------------------------------------------------


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_dataset_pickles_into_dataloader_workers(tmp_path, ctx):
    import torch.utils.data

    run(cfg(tmp_path, limit=4))
    ds = HiddenStatesDataset(tmp_path / "out")
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx)
    got = {x["meta"]["id"]: x["hidden"].shape for x in dl}
    assert sorted(got) == sorted(ShardReader(tmp_path / "out").ids)


# --- the RAM disk: ownership by flock, across PID namespaces and for PID 1 ------------------


def sglang_args(port, limit):
    from test_sglang_backend import FAKE

    return [
        "backend=sglang",
        f"server.command=[{FAKE[0]},{FAKE[1]}]",
        f"server.port={port}",
        "server.args.chunked_prefill_size=64",
        "client.concurrency=2",
        "capture.dump_timeout_s=30",
        f"data.limit={limit}",
    ]


def in_new_pid_namespace(tmp, name, *args):
    """A recipe as PID 1 of its own PID namespace, as in a container (`unshare --pid`)."""
    return recipe_cli(tmp, *args, out=tmp / name, wait=False, prefix=("unshare", "--pid", "--fork", "--mount-proc"))


def wait_for(cond, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="PID namespaces need root and util-linux's unshare"
)


@pytest.mark.slow
@needs_unshare
def test_runs_in_separate_pid_namespaces_never_remove_each_others_dump_folder(tmp_path):
    """A runs in this namespace (its PID does not exist in B's); B is PID 1 of its own. Both share the
    dump root, as two containers with `ipc: host` share /dev/shm. B starts while A is mid-run."""
    from test_sglang_backend import free_port

    a = recipe_cli(tmp_path, *sglang_args(free_port(), 16), env={"FAKE_SGLANG_MODE": "slow"}, wait=False)
    wait_for(lambda: list((tmp_path / "shm").glob("user-*/run-*")), what="A's dump folder")
    b = in_new_pid_namespace(tmp_path, "b", "data.limit=8")
    out_b, _ = b.communicate(timeout=300)
    out_a, _ = a.communicate(timeout=300)
    assert b.returncode == 0, out_b[-3000:]
    assert a.returncode == 0, out_a[-3000:]
    exactly_once(tmp_path / "out", 16)
    exactly_once(tmp_path / "b", 8)


@pytest.mark.slow
@needs_unshare
def test_a_killed_pid_1_runs_folder_is_removed_by_the_next_run(tmp_path):
    p = in_new_pid_namespace(tmp_path, "a", "data.limit=40", "backend.batch_size=1")
    wait_for(lambda: list((tmp_path / "shm").glob("user-*/run-*")), what="the dump folder")
    pid1 = int(subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(pid1, signal.SIGKILL)  # the container's PID 1, killed past its stop grace period
    p.wait()
    stale = list((tmp_path / "shm").glob("user-*/run-*"))
    assert len(stale) == 1
    q = in_new_pid_namespace(tmp_path, "a", "data.limit=40")  # the next container: PID 1 as well
    out, _ = q.communicate(timeout=300)
    assert q.returncode == 0, out[-3000:]
    assert not list((tmp_path / "shm").glob("user-*/run-*")), "the killed run's folder must be gone"
    exactly_once(tmp_path / "a", 40)


# --- a launched server never outlives its run ------------------------------------------------


@pytest.mark.slow
def test_kill_9_takes_the_server_along_and_the_resume_finishes(tmp_path):
    from test_sglang_backend import free_port

    from recipe.backends.sglang import port_in_use

    port = free_port()
    p = recipe_cli(tmp_path, *sglang_args(port, 12), env={"FAKE_SGLANG_MODE": "slow"}, wait=False)
    wait_for(lambda: (tmp_path / "out" / "index.jsonl").exists() and index_bytes(tmp_path), what="a first sample")
    assert port_in_use("127.0.0.1", port)
    p.send_signal(signal.SIGKILL)
    p.wait()
    wait_for(lambda: not port_in_use("127.0.0.1", port), timeout=15, what="the server to die with the recipe")
    rc, out = recipe_cli(tmp_path, *sglang_args(port, 12))
    assert rc == 0, out[-3000:]
    exactly_once(tmp_path / "out", 12)
    assert not (tmp_path / "out" / ".server.json").exists()


def test_a_server_this_run_did_not_start_is_never_used(tmp_path, tiny_model_dir):
    from test_sglang_backend import FAKE, free_port

    port = free_port()
    other = subprocess.Popen(
        [*FAKE, "--model-path", str(tiny_model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from recipe.backends.sglang import port_in_use

        wait_for(lambda: port_in_use("127.0.0.1", port), what="the other server")
        rc, out = recipe_cli(tmp_path, *sglang_args(port, 4))
        assert rc != 0 and "already in use by a server this run did not start" in out and "Traceback" not in out
        assert not (tmp_path / "out" / "index.jsonl").exists() or not index_bytes(tmp_path)
    finally:
        other.kill()
        other.wait()


# --- every user-facing failure is one line with the fix ---------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        ("+captur.layers=[1,3]", "unknown config key(s) captur"),
        ("shards.zstd_level=99", "shards.zstd_level=99"),
        ("data.limit=-5", "data.limit=-5 must be >= 1"),
        ("data.max_failures=-1", "data.max_failures=-1.0 must be >= 0"),
        ("capture.writer_threads=0", "capture.writer_threads=0 must be >= 1"),
        ("data.max_length=100000", "exceeds the model's max_position_embeddings=8192"),
    ],
)
def test_bad_config_fails_first_in_one_line(tmp_path, override, message):
    rc, out = recipe_cli(tmp_path, override)
    assert rc == 2 and message in out and "Traceback" not in out, out
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_output_dir_that_is_a_file_or_read_only_fails_before_tokenizing(tmp_path):
    (tmp_path / "file").write_text("x")
    rc, out = recipe_cli(tmp_path, out=tmp_path / "file")
    assert rc == 2 and "is a file" in out and "plan:" not in out
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() != 0:  # root writes anywhere; the check is still exercised above
        rc, out = recipe_cli(tmp_path, out=ro / "out")
        assert rc == 2 and "not writable" in out


def test_the_resume_message_prints_the_exact_command(monkeypatch):
    from types import SimpleNamespace

    from recipe.main import resume_command

    monkeypatch.setattr(sys, "argv", ["/x/recipe/__main__.py", "capture.layers=[1,2]", "data.limit=9"])
    cmd = resume_command(SimpleNamespace(output_dir="/data/out 1"))
    assert cmd == "python -m recipe 'capture.layers=[1,2]' data.limit=9 'output_dir=/data/out 1'"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_dump_folders_are_private_and_a_root_run_never_locks_a_user_out():
    """The RAM disk is shared by every local user: a run's hidden states live under
    <dump_dir>/user-<uid> (0700); the parent a root run makes is sticky and world-writable like /tmp,
    so another user's later run makes its own folder there and cannot read root's."""
    import tempfile

    from recipe.capture.dumpdir import dump_dir

    base = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        base.chmod(0o755)
        shm = base / "hs-recipe"
        with dump_dir(shm) as mine:
            (mine / "states.bin").write_bytes(b"private")
            assert (shm.stat().st_mode & 0o7777) == 0o1777
            assert (mine.parent.stat().st_mode & 0o777) == 0o700 and mine.parent.name == "user-0"
            assert (mine.stat().st_mode & 0o777) == 0o700
            assert as_user(65534, lambda: second_users_run(shm, mine)) == ["user-65534", "0o700", "DENIED"]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def second_users_run(shm, other):
    from recipe.capture.dumpdir import dump_dir

    with dump_dir(shm) as d:
        seen = [d.parent.name, oct(d.parent.stat().st_mode & 0o777)]
    try:
        os.listdir(other)
        return [*seen, "READ"]
    except PermissionError:
        return [*seen, "DENIED"]


def as_user(uid, fn):
    """fn() in a forked child running as uid (no exec: the venv may not be readable by that user)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def test_a_resume_appends_to_the_sets_open_shards_rather_than_starting_new_files(tmp_path):
    """Redoing a few samples does not open a new shard per worker: each writer continues a shard of
    the set that ends on a whole record and has room (one writer per file)."""
    run(cfg(tmp_path, "shards.workers=2", limit=6))
    before = sorted(p.name for p in (tmp_path / "out" / "shards").glob("shard-*.bin"))
    counts = run(cfg(tmp_path, "shards.workers=2", limit=9))
    after = sorted(p.name for p in (tmp_path / "out" / "shards").glob("shard-*.bin"))
    assert counts["ok_this_run"] == 3 and after == before
    reader = ShardReader(tmp_path / "out")
    assert len(reader) == 9 and {r["shard"] for r in reader.records} <= set(before)
    assert verify(tmp_path / "out") == []


def test_a_resume_never_appends_to_a_shard_whose_tail_it_left_alone(tmp_path):
    """Bytes after a shard's last record that are not a record are left as they are (not provably
    the recipe's to cut); new samples then go to a new shard, never after those bytes."""
    run(cfg(tmp_path, "shards.workers=1", limit=4))
    (shard,) = (tmp_path / "out" / "shards").glob("shard-*.bin")
    with open(shard, "ab") as f:
        f.write(b"not a record")
    size = shard.stat().st_size
    counts = run(cfg(tmp_path, "shards.workers=1", limit=6))
    assert counts["ok_this_run"] == 2 and shard.stat().st_size == size
    assert len(ShardReader(tmp_path / "out")) == 6


def test_an_index_line_is_json_exactly_as_json_reads_it(tmp_path):
    """The fast parse of index lines (the whole file as one JSON array) reads what json.loads reads
    line by line (a line with spaces around it, a blank line skipped) and refuses what it refuses
    (garbage after a record, two records on one line, bytes that are not UTF-8), naming the line."""
    from recipe.errors import CorruptFile
    from recipe.shards.store import read_index

    good = [{"id": f"s{i}", "key": "k", "shard": "shard-00000.bin", "offset": i, "length": 1, "tokens": 1,
             "raw_bytes": 1, "crc32": 0} for i in range(3)]  # fmt: skip
    lines = [json.dumps(r).encode() for r in good]
    (tmp_path / "index.jsonl").write_bytes(b"\n".join([lines[0], b"  " + lines[1] + b" ", lines[2]]) + b"\n")
    assert read_index(tmp_path) == good
    (tmp_path / "index.jsonl").write_bytes(b"\n".join([lines[0], b"", lines[1], lines[2]]) + b"\n")
    assert read_index(tmp_path) == good
    for bad in (lines[1] + b'{"id": "x"}', lines[1] + b', {"id": "x"}', lines[1][:-1] + b', "s": "\xff"}'):
        (tmp_path / "index.jsonl").write_bytes(b"\n".join([lines[0], bad, lines[2]]) + b"\n")
        with pytest.raises(CorruptFile, match=r"index.jsonl: line 2 is not JSON.*recipe.shards repair"):
            read_index(tmp_path)
