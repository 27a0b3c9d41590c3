"""The commands around a run keep the store's promise: export, repair, merge and the token counts never
delete, cut or serve bytes they cannot prove are the set's own, and name all the damage they find.

Each test builds the attack from a finished set (copied afresh), runs the command a user would run,
and checks what is left on disk and what a reader serves.
"""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import small_run_cfg as cfg

from recipe.main import run
from recipe.shards import ShardReader
from recipe.shards import tokencounts as tc
from recipe.shards import verify as verify_mod
from recipe.shards.__main__ import main as shards_cli
from recipe.shards.export import export_lock
from recipe.shards.verify import verify

N = 10
EXTRA = ("shards.max_shard_gb=0.0004", "shards.commit_every=1", "shards.workers=1")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished")
    run(cfg(tmp, *EXTRA, limit=N))
    return tmp / "out"


@pytest.fixture(scope="module")
def other_layers(tmp_path_factory):
    """A set of other samples (the records past N) captured at other layers: a stray's source."""
    tmp = tmp_path_factory.mktemp("other")
    run(cfg(tmp, *EXTRA, "capture.layers=[1,2]", "data.num_shards=2", "data.shard_index=1", limit=2 * N))
    return tmp / "out"


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A set of other samples at the same layers, from another model (its records' slots are ours)."""
    tmp = tmp_path_factory.mktemp("other-model")
    run(cfg(tmp, *EXTRA, "model.path=builtin:tiny-qwen3", "data.num_shards=2", "data.shard_index=1", limit=2 * N))
    return tmp / "out"


def fresh(src, dest):
    shutil.copytree(src, dest)
    return dest


def cli(*args, capsys) -> tuple[int, str]:
    code = shards_cli([str(a) for a in args])
    text = capsys.readouterr()
    return code, text.out + text.err


def served(out) -> dict:
    r = ShardReader(out)
    return {i: tuple(a.tobytes() for a in r.get_numpy(i)[1].values()) for i in r.ids}


def lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]


# export ----------------------------------------------------------------------------------------
def test_export_overwrite_never_deletes_a_set_nested_anywhere_under_out(finished, tmp_path, capsys):
    out = tmp_path / "exports"
    nested = fresh(finished, out / "outputs" / "2026-12-06" / "run")
    before = served(nested)
    code, text = cli("export", "--to", "specforge", "--overwrite", finished, out, capsys=capsys)
    assert code == 2 and "holds a shard set" in text and str(nested) in text
    assert served(nested) == before and verify(nested) == []


@pytest.mark.parametrize("how", ["its shards folder", "a link into it"])
def test_export_into_another_set_is_refused(finished, tmp_path, how, capsys):
    other = fresh(finished, tmp_path / "other")
    before = served(other)
    target = other / "shards"
    if how == "a link into it":
        (tmp_path / "link").symlink_to(other)
        target = tmp_path / "link" / "shards"
    code, text = cli("export", "--to", "specforge", "--overwrite", finished, target, capsys=capsys)
    assert code == 2 and "lies inside the shard set" in text and len(text.strip().splitlines()) == 1
    assert served(other) == before and verify(other) == []


def test_export_stages_in_a_folder_of_its_own_never_a_users(finished, tmp_path, capsys):
    mine = tmp_path / ".out.export-partial"  # the name older exports staged in, and removed
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    code, _ = cli("export", "--to", "specforge", finished, tmp_path / "out", capsys=capsys)
    assert code == 0 and (mine / "keep.txt").read_text() == "the user's"
    assert not [p for p in tmp_path.iterdir() if ".out.export-" in p.name and p != mine and p.is_dir()]


def test_a_second_export_into_the_same_out_is_refused_while_one_runs(finished, tmp_path, capsys):
    out = tmp_path / "out"
    with export_lock(out):  # the first export, still writing
        code, text = cli("export", "--to", "specforge", finished, out, capsys=capsys)
    assert code == 2 and "another export is writing" in text and "exported" not in text
    assert not out.exists()


# repair and resume -----------------------------------------------------------------------------
def test_a_stray_shard_of_another_set_is_never_indexed_or_served(finished, other_layers, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    before = served(out)
    stray = out / "shards" / "shard-00042.bin"
    shutil.copyfile(other_layers / "shards" / "shard-00000.bin", stray)
    code, text = cli("repair", out, capsys=capsys)
    assert "shard-00042.bin" in text and "another set" in text
    assert served(out) == before and all(r["shard"] != stray.name for r in lines(out))
    assert stray.read_bytes() == (other_layers / "shards" / "shard-00000.bin").read_bytes()
    run(cfg(tmp_path, *EXTRA, limit=N))  # a resume of the set: the same
    assert served(out) == before
    cli("verify", out, capsys=capsys)
    assert "another set or model" in capsys.readouterr().out + text


def test_a_stray_shard_of_another_model_at_the_same_layers_is_never_indexed(finished, other_model, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    before = served(out)
    shutil.copyfile(other_model / "shards" / "shard-00000.bin", out / "shards" / "shard-00042.bin")
    code, text = cli("repair", out, capsys=capsys)
    assert "shard-00042.bin" in text and "its key is not" in text
    assert served(out) == before


def test_repair_never_cuts_a_tail_a_hard_link_shares_with_a_live_set(finished, tmp_path, capsys):
    live, merged = fresh(finished, tmp_path / "live"), tmp_path / "merged"
    assert cli("merge", merged, live, capsys=capsys)[0] == 0
    shard = sorted((live / "shards").glob("shard-*.bin"))[-1]
    size = shard.stat().st_size
    with open(shard, "ab") as f:  # the live run's append in flight: a record's first bytes
        f.write(shard.read_bytes()[:4096])
    cli("repair", merged, capsys=capsys)
    assert shard.stat().st_size == size + 4096  # nothing cut through the link


def test_merging_merged_sets_gives_a_whole_set(finished, tmp_path, capsys):
    a, b = fresh(finished, tmp_path / "a"), fresh(finished, tmp_path / "b")
    shutil.rmtree(b)
    run(cfg(tmp_path / "bb", *EXTRA, "data.num_shards=2", "data.shard_index=1", limit=2 * N))
    b = tmp_path / "bb" / "out"
    for name, inputs in (("node0", [a]), ("node1", [b]), ("all", [tmp_path / "node0", tmp_path / "node1"])):
        assert cli("merge", tmp_path / name, *inputs, capsys=capsys)[0] == 0
    whole = tmp_path / "all"
    assert verify(whole) == [] and served(whole) == {**served(a), **served(b)}


# token counts ----------------------------------------------------------------------------------
def test_edited_token_counts_are_caught_by_verify_and_rebuilt_by_repair(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    path = out / "token_counts.npz"
    z = dict(np.load(path))
    loss = z["loss_counts"].copy()
    loss[0], loss[1] = loss[0] + 2, loss[1] - 2  # the same totals, the same digest
    np.savez(path, **{**z, "loss_counts": loss})
    assert any("token_counts.npz does not hold" in p for p in verify(out))
    cli("repair", out, capsys=capsys)
    assert verify(out) == []
    counts = tc.Counts.from_file(path)
    assert tc.same(counts, tc.catch_up(tc.Counts(), out, lines(out)))


def test_verify_counts_tokens_in_its_workers_as_one_reader_counts_them_in_order(finished, tmp_path, monkeypatch):
    out = fresh(finished, tmp_path / "out")
    monkeypatch.setattr(verify_mod, "RANGE_RECORDS", 1)  # a range per sample: every join between ranges is met
    assert verify(out, workers=2) == []
    z = dict(np.load(out / tc.FILE))
    order = np.arange(z["loss_ids"].size)
    order[-2:] = order[-2:][::-1]  # the last two ids first seen the other way round: counts and totals the same
    np.savez(out / tc.FILE, **{**z, "loss_ids": z["loss_ids"][order], "loss_counts": z["loss_counts"][order]})
    assert any(f"{tc.FILE} does not hold" in p for p in verify(out, workers=2))


def test_counts_whose_totals_disagree_with_the_index_are_never_used(finished, tmp_path):
    out = fresh(finished, tmp_path / "out")
    z = dict(np.load(out / "token_counts.npz"))
    np.savez(out / "token_counts.npz", **{**z, "loss_counts": z["loss_counts"] * 2})
    counts = tc.load(out, lines(out))
    assert int(counts.loss.sum()) == sum(r["loss_tokens"] for r in lines(out))


def test_token_ids_past_65535_round_trip_a_200k_vocabulary(tmp_path):
    ids = np.array([5, 65535, 65536, 131072, 199_999, 65536], np.int64)
    counts = tc.Counts()
    counts.add("k", ids, np.ones(ids.size, np.uint8))
    (tmp_path / tc.FILE).write_bytes(counts.to_bytes())
    back = tc.Counts.from_file(tmp_path / tc.FILE)
    assert tc.same(back, counts) and back.loss[65536] == 2 and back.loss[199_999] == 1


# verify and repair name all the damage ---------------------------------------------------------
def _spoil(out, rec, at=200):
    with open(out / "shards" / rec["shard"], "r+b") as f:
        f.seek(rec["offset"] + at)
        f.write(b"\xff" * 8)


def test_a_shard_cut_short_does_not_hide_other_damage_in_it(finished, tmp_path):
    out = fresh(finished, tmp_path / "out")
    first = lines(out)[0]
    mine = [r for r in lines(out) if r["shard"] == first["shard"]]
    assert len(mine) >= 2
    _spoil(out, mine[0])
    os.truncate(out / "shards" / first["shard"], mine[-1]["offset"] + 10)
    problems = "\n".join(verify(out))
    assert mine[0]["id"] in problems and mine[-1]["id"] in problems and "cut short" in problems


def test_with_the_index_lost_repair_names_the_damaged_record(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    bad = lines(out)[1]
    _spoil(out, bad)
    (out / "index.jsonl").unlink()
    code, text = cli("repair", out, capsys=capsys)
    assert code == 1 and f"lost {bad['id']}" in text
    problems = verify(out)
    assert problems and any(bad["id"] in p and "damaged" in p for p in problems)
    assert not any("indexes it" in p for p in problems)  # never advice that sends the user in circles


def test_with_the_index_lost_a_record_damaged_in_its_low_plane_is_never_indexed_as_whole(finished, tmp_path, capsys):
    """Frame B is raw bytes with no zstd checksum; a v3 record's check frame holds its crc32, so a scan
    without the index tells the damage: repair names the record lost, and nothing serves it."""
    out = fresh(finished, tmp_path / "out")
    bad = lines(out)[1]
    _spoil(out, bad, at=bad["length"] - 12 - 40)  # inside the last raw block, before the check frame
    (out / "index.jsonl").unlink()
    code, text = cli("repair", out, capsys=capsys)
    assert code == 1 and f"lost {bad['id']}" in text
    assert bad["id"] not in {r["id"] for r in lines(out)}
    assert any(bad["id"] in p and "damaged" in p for p in verify(out))


def test_the_manifest_straight_after_a_repair_agrees_with_the_index(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    _spoil(out, lines(out)[2])
    (out / "index.jsonl").unlink()
    cli("repair", out, capsys=capsys)
    m, recs = json.loads((out / "manifest.json").read_text()), lines(out)
    assert m["totals"]["samples"] == len(recs) == m["counts"]["ok"]
    assert m["totals"]["tokens"] == sum(r["tokens"] for r in recs) == m["token_counts"]["tokens"]
    assert m["token_counts"]["loss_tokens"] == sum(r["loss_tokens"] for r in recs)
    assert not [p for p in verify(out) if "manifest" in p or "accounting" in p]


@pytest.mark.parametrize("cmd", ["run", "export", "merge", "vocab-map"])
def test_no_command_writes_inside_another_set_reached_through_a_link(finished, tmp_path, cmd, capsys):
    other = fresh(finished, tmp_path / "other")
    before, listing = served(other), sorted(p.relative_to(other) for p in other.rglob("*"))
    (tmp_path / "link").symlink_to(other)
    inside = tmp_path / "link" / "shards" / "mine"
    if cmd == "run":
        from recipe.errors import UserError

        with pytest.raises(UserError, match="lies inside the shard set"):
            run(cfg(tmp_path, *EXTRA, f"output_dir={inside}", limit=N))
    else:
        args = {"export": ["export", "--to", "specforge", finished, inside], "merge": ["merge", inside, finished],
                "vocab-map": ["vocab-map", "--draft-vocab", "32", "--out", inside, finished]}[cmd]  # fmt: skip
        code, text = cli(*args, capsys=capsys)
        assert code == 2 and "lies inside the shard set" in text
    assert served(other) == before and sorted(p.relative_to(other) for p in other.rglob("*")) == listing


def test_vocab_map_still_writes_under_its_own_sets_vocab_folder(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path / "out")
    assert cli("vocab-map", "--draft-vocab", "32", out, capsys=capsys)[0] == 0
    assert (out / "vocab" / "draft-32" / "d2t.npy").exists() and verify(out) == []


def test_vocab_map_never_writes_through_a_link_left_in_its_folder(finished, tmp_path, capsys):
    out, mine = tmp_path / "vm", tmp_path / "notes.txt"
    assert cli("vocab-map", "--draft-vocab", "32", "--out", out, finished, capsys=capsys)[0] == 0
    mine.write_text("the user's")
    for name in ("d2t.npy", "vocab_mapping.pt"):
        (out / name).unlink()
        (out / name).symlink_to(mine)
    assert cli("vocab-map", "--draft-vocab", "32", "--out", out, finished, capsys=capsys)[0] == 0
    assert mine.read_text() == "the user's" and not (out / "d2t.npy").is_symlink()


def test_rebuild_index_never_writes_through_a_link(finished, tmp_path, capsys):
    out, mine = fresh(finished, tmp_path / "out"), tmp_path / "notes.txt"
    mine.write_text("the user's")
    (out / "index.rebuilt.jsonl").symlink_to(mine)
    assert cli("rebuild-index", out, capsys=capsys)[0] == 0
    assert mine.read_text() == "the user's" and len(lines(out)) == len(
        (out / "index.rebuilt.jsonl").read_text().splitlines()
    )


# the next attacks on the commands that write (docs/guarantees.md lists them) --------------------
def test_export_into_a_file_or_a_link_to_a_folder_is_refused(finished, tmp_path, capsys):
    (tmp_path / "file").write_text("the user's")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    for out, says in ((tmp_path / "file", "is a file"), (tmp_path / "link", "is a symbolic link")):
        code, text = cli("export", "--to", "specforge", finished, out, capsys=capsys)
        assert code == 2 and says in text
    assert (tmp_path / "file").read_text() == "the user's" and not any((tmp_path / "empty").iterdir())


def test_merging_one_set_twice_keeps_each_sample_once(finished, tmp_path, capsys):
    assert cli("merge", tmp_path / "m", finished, finished, capsys=capsys)[0] == 0
    assert served(tmp_path / "m") == served(finished) and verify(tmp_path / "m") == []


def test_merge_into_a_folder_holding_an_input_or_a_users_file_is_refused(finished, tmp_path, capsys):
    inner = fresh(finished, tmp_path / "p" / "in")
    code, text = cli("merge", tmp_path / "p", inner, capsys=capsys)
    assert code == 2 and "holds the input" in text and verify(inner) == []
    (tmp_path / "m" / "shards").mkdir(parents=True)
    name = f"set000-{lines(finished)[0]['shard']}"
    (tmp_path / "m" / "shards" / name).write_text("the user's")
    code, text = cli("merge", tmp_path / "m", finished, capsys=capsys)
    assert code == 2 and (tmp_path / "m" / "shards" / name).read_text() == "the user's"


def test_vocab_map_never_fills_a_users_folder_or_follows_a_linked_default(finished, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    code, text = cli("vocab-map", "--draft-vocab", "32", "--out", tmp_path / "mine", finished, capsys=capsys)
    assert code == 2 and "did not write" in text and sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]
    out = fresh(finished, tmp_path / "out")
    (out / "vocab").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "vocab" / "draft-32").symlink_to(tmp_path / "elsewhere")
    code, text = cli("vocab-map", "--draft-vocab", "32", out, capsys=capsys)
    assert code == 2 and "not a folder" in text and not any((tmp_path / "elsewhere").iterdir())


def test_repair_of_a_set_a_run_is_writing_is_one_line_and_changes_nothing(finished, tmp_path, capsys):
    import fcntl

    out = fresh(finished, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with open(out / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the live run
        code, text = cli("repair", out, capsys=capsys)
    assert code == 2 and "being written by another process" in text
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
