"""Every failure of the shard commands is one line and exit 2, never a traceback, and where the line
says what to run, running it fixes the problem."""

import errno
import json
import os
import re
import shutil

import pytest
from conftest import small_run_cfg as cfg

from recipe.main import run
from recipe.shards.__main__ import main as shards_cli
from recipe.shards.verify import verify

N = 8


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished")
    run(cfg(tmp, "shards.max_shard_gb=0.0004", "shards.workers=1", limit=N))
    return tmp / "out"


def fresh(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "out")


PROGRESS = re.compile(r"^export \w+: \d+/\d+ samples")  # long work's progress lines, before any failure


def one_line(capsys, *args) -> tuple[int, str]:
    try:
        code = shards_cli([str(a) for a in args])
    except KeyboardInterrupt:  # would stop pytest itself
        pytest.fail("Ctrl-C escaped the command as a traceback")
    text = capsys.readouterr()
    assert "Traceback" not in text.err + text.out
    return code, "\n".join(x for x in text.err.strip().splitlines() if not PROGRESS.match(x))


def refused(capsys, *args) -> str:
    code, err = one_line(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def raising(error):
    def fail(*a, **k):
        raise error

    return fail


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
def test_a_read_only_destination_is_one_line(finished, tmp_path, monkeypatch, capsys, err):
    import recipe.shards.export as export

    monkeypatch.setattr(export.tempfile, "mkdtemp", raising(OSError(err, os.strerror(err), str(tmp_path))))
    line = refused(capsys, "export", "--to", "specforge", finished, tmp_path / "x")
    assert "cannot write" in line and str(tmp_path) in line


def test_a_read_only_set_is_one_line_for_repair(finished, tmp_path, monkeypatch, capsys):
    import recipe.shards.store as store

    out = fresh(finished, tmp_path)
    monkeypatch.setattr(store, "open_owned", raising(OSError(errno.EROFS, "Read-only file system", str(out))))
    assert "cannot write" in refused(capsys, "repair", out)


@pytest.mark.parametrize("cmd", ["export", "vocab-map", "merge"])
def test_a_full_disk_is_one_line(finished, tmp_path, monkeypatch, capsys, cmd):
    import recipe.shards.export as export
    import recipe.shards.merge as merge
    import recipe.shards.vocabmap as vocabmap

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path))
    monkeypatch.setattr(export, "_write_text", raising(full))
    monkeypatch.setattr(vocabmap.np, "save", raising(full))
    monkeypatch.setattr(merge, "atomic_write", raising(full))
    args = {"export": ["export", "--to", "specforge", finished, tmp_path / "x"],
            "vocab-map": ["vocab-map", "--draft-vocab", "64", "--out", tmp_path / "v", finished],
            "merge": ["merge", tmp_path / "m", finished]}[cmd]  # fmt: skip
    assert "disk full" in refused(capsys, *args)


@pytest.mark.parametrize("cmd", ["export", "repair"])
def test_ctrl_c_is_one_line_and_the_same_command_then_finishes(finished, tmp_path, monkeypatch, capsys, cmd):
    import recipe.shards.export as export
    import recipe.shards.mend as mend

    out = fresh(finished, tmp_path)
    args = ["export", "--to", "specforge", out, tmp_path / "x"] if cmd == "export" else ["repair", out]
    with monkeypatch.context() as m:
        m.setattr(export, "_write_text", raising(KeyboardInterrupt()))
        m.setattr(mend, "summarize", raising(KeyboardInterrupt()))
        assert "the same command again" in refused(capsys, *args)
    assert one_line(capsys, *args)[0] == 0 and verify(out) == []


def test_a_merge_killed_while_copying_reruns_to_a_whole_set(finished, tmp_path, monkeypatch, capsys):
    import recipe.shards.merge as merge

    monkeypatch.setattr(merge.os, "link", raising(OSError(errno.EXDEV, "cross-device link")))
    out = tmp_path / "m"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / ".set000-shard-00000.bin.copy").write_bytes(b"half a copy")  # an older merge's leftover
    with monkeypatch.context() as m:
        m.setattr(merge, "atomic_write", raising(KeyboardInterrupt()))  # killed after its copies, before the index
        refused(capsys, "merge", out, finished)
    assert one_line(capsys, "merge", out, finished)[0] == 0
    assert verify(out) == []


def test_a_manifest_with_a_null_model_is_one_line_that_leads_to_the_fix(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "model": None}))
    for args in (["export", "--to", "specforge", out, tmp_path / "x"], ["vocab-map", "--draft-vocab", "64", out]):
        line = refused(capsys, *args)
        assert "python -m recipe" in line or "--target-vocab" in line, line
    run(cfg(tmp_path, "shards.max_shard_gb=0.0004", "shards.workers=1", limit=N))  # the fix the line names
    assert json.loads((out / "manifest.json").read_text())["model"]["name"]


def test_token_counts_that_are_a_folder_are_one_line_and_the_advice_fixes_it(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    (out / "token_counts.npz").unlink()
    (out / "token_counts.npz").mkdir()
    problems = verify(out)
    assert any("move it away" in p for p in problems)
    assert "move it away" in refused(capsys, "repair", out)
    (out / "token_counts.npz").rmdir()  # what the line says
    assert one_line(capsys, "repair", out)[0] == 0 and verify(out) == []


def test_a_folder_named_like_a_shard_is_never_read(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    (out / "shards" / "shard-00077.bin").mkdir()
    for args in (["verify", out], ["repair", out], ["rebuild-index", out], ["merge", tmp_path / "m", out]):
        assert one_line(capsys, *args)[0] == 0, args
    assert verify(tmp_path / "m") == []


def test_rebuild_index_over_a_damaged_record_names_it_and_indexes_the_rest(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    recs = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    with open(out / "shards" / recs[1]["shard"], "r+b") as f:
        f.seek(recs[1]["offset"] + 200)
        f.write(b"\xff" * 8)
    code = shards_cli(["rebuild-index", str(out)])
    text = capsys.readouterr().out
    rebuilt = [json.loads(x) for x in (out / "index.rebuilt.jsonl").read_text().splitlines()]
    assert code == 0 and "left out" in text and recs[1]["shard"] in text
    assert {r["id"] for r in rebuilt} == {r["id"] for r in recs} - {recs[1]["id"]}


def test_a_bad_draft_vocab_is_refused_before_any_sample_is_written(finished, tmp_path, monkeypatch, capsys):
    import recipe.shards.export as export

    monkeypatch.setattr(export, "_write_stage", raising(AssertionError("samples written before the check")))
    for n in ("0", "100000"):
        assert "--draft-vocab" in refused(
            capsys, "export", "--to", "specforge", "--draft-vocab", n, finished, tmp_path / "x"
        )


def test_inspect_tells_a_newcomer_what_is_in_the_set(finished, capsys):
    assert shards_cli(["inspect", str(finished)]) == 0
    text = capsys.readouterr().out
    for word in ("tiny-llama", "layer_1", "final_post_norm", "lossless", f"samples  {N}", "GB stored", "ok 8"):
        assert word in text, word
    first = json.loads((finished / "index.jsonl").read_text().splitlines()[0])
    assert first["id"] in text and "<|im_start|>" in text  # the first samples, with their first words


def test_inspect_still_summarizes_a_set_whose_shard_is_gone(finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "set"
    shutil.copytree(finished, out)
    first = json.loads((out / "index.jsonl").read_text().splitlines()[0])
    (out / "shards" / first["shard"]).unlink()
    assert shards_cli(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"samples  {N}" in text and f"{first['id']}" in text
    assert f"(unreadable: python -m recipe.shards verify {out})" in text  # names the command that says why


def test_show_marks_the_loss_masked_tokens_and_gives_each_slots_norm(finished, capsys):
    from recipe.shards import ShardReader

    r = ShardReader(finished)
    sid = r.ids[0]
    assert shards_cli(["show", str(finished), sid]) == 0
    text = capsys.readouterr().out
    ids, mask = (r.get_numpy(sid)[1][k] for k in ("input_ids", "loss_mask"))
    assert f"{len(ids)} tokens, {int(mask.sum())} loss-masked" in text
    assert all(s in text for s in r.slots) and "norm per token" in text
    assert text.count("[[") >= 1 and "[[<|im_start|>" not in text  # answers marked, never the prompt header
    assert "no sample 'nope'" in refused(capsys, "show", finished, "nope")


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        shards_cli(["--help"])
    text = capsys.readouterr().out
    for cmd in ("inspect", "show", "verify", "repair", "rebuild-index", "export", "vocab-map", "merge"):
        assert f"\n{cmd} " in text, cmd
