"""Nothing the user owns is ever destroyed: no command deletes, truncates or overwrites bytes it
cannot prove it wrote and did not commit; every damaged set is repaired or refused in one line.

Each test damages a finished set the way an adversarial user (or a machine) would, runs the
commands on it, and checks that every record that was whole before is still whole in the set, or is
named as lost by verify and redone by a resume whose input holds it.
"""

import io
import json
import shutil

import pytest
from conftest import small_run_cfg as cfg

from recipe.errors import CorruptFile, UserError
from recipe.main import run
from recipe.shards import ShardReader, repair
from recipe.shards.__main__ import main as shards_cli
from recipe.shards.store import Unreadable
from recipe.shards.verify import verify

N = 12
EXTRA = ("shards.max_shard_gb=0.0004", "shards.commit_every=1", "shards.workers=1")  # ~430 KB: several records a shard


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished set (N samples, several records in each shard), copied afresh by each test."""
    tmp = tmp_path_factory.mktemp("finished")
    run(cfg(tmp, *EXTRA, limit=N))
    return tmp / "out"


def fresh(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "out")
    return tmp_path / "out"


def resume(tmp_path, *more, limit=N):
    return run(cfg(tmp_path, *EXTRA, *more, limit=limit))


def samples(out) -> dict:
    """id -> (input_ids, hidden) as bytes, read back through the reader."""
    r = ShardReader(out)
    return {i: tuple(a.tobytes() for a in r.get_numpy(i)[1].values()) for i in r.ids}


def lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]


def write_lines(out, recs) -> None:
    (out / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def cli(*args, capsys=None) -> tuple[int, str]:
    code = shards_cli([str(a) for a in args])
    text = capsys.readouterr() if capsys else None
    return code, (text.out + text.err) if text else ""


# 1 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["the set", "its parent", "inside it", "a link to it"])
def test_an_export_never_writes_over_its_own_set(finished, tmp_path, where, capsys):
    out = fresh(finished, tmp_path)
    before = samples(out)
    target = {"the set": out, "its parent": tmp_path, "inside it": out / "shards",
              "a link to it": tmp_path / "link"}[where]  # fmt: skip
    if where == "a link to it":
        target.symlink_to(out)
    code, text = cli("export", "--to", "specforge", "--overwrite", out, target, capsys=capsys)
    assert code == 2 and "destroy" in text and len(text.strip().splitlines()) == 1
    assert verify(out) == [] and samples(out) == before


def test_export_overwrite_never_deletes_a_shard_set(finished, tmp_path, capsys):
    out, other = fresh(finished, tmp_path), tmp_path / "other"
    shutil.copytree(finished, other)
    theirs = samples(other)
    code, text = cli("export", "--to", "specforge", "--overwrite", out, other, capsys=capsys)
    assert code == 2 and "holds a shard set" in text and samples(other) == theirs and verify(other) == []
    assert cli("export", "--to", "specforge", out, tmp_path / "ex")[0] == 0
    assert cli("export", "--to", "specforge", "--overwrite", out, tmp_path / "ex")[0] == 0


# 2 ---------------------------------------------------------------------------------------------
def test_a_merge_again_into_an_interrupted_merge_never_writes_into_its_inputs(finished, tmp_path, capsys):
    a = fresh(finished, tmp_path)
    b = tmp_path / "b"
    shutil.copytree(finished, b)
    before = samples(a)
    merged = tmp_path / "merged"
    assert cli("merge", merged, a, b)[0] == 0
    (merged / "index.jsonl").unlink()  # an interrupted merge: its shards linked, no index yet
    (merged / "manifest.json").unlink()
    (merged / "identity.json").unlink()
    assert cli("merge", merged, a, b, capsys=capsys)[0] == 0
    assert verify(a) == [] and samples(a) == before and verify(merged) == []
    again = tmp_path / "again"
    (again / "shards").mkdir(parents=True)
    (again / "shards" / "set000-shard-00000.bin").write_bytes(b"someone else's file")
    code, text = cli("merge", again, a, b, capsys=capsys)
    assert code == 2 and "exists and is not" in text
    assert (again / "shards" / "set000-shard-00000.bin").read_bytes() == b"someone else's file"
    for target in (a, tmp_path):
        code, text = cli("merge", target, a, b, capsys=capsys)
        assert code == 2 and "destroy" in text
    assert verify(a) == [] and samples(a) == before


# 3 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deleted", "emptied", "shortened"])
def test_a_lost_index_is_rebuilt_from_the_shards_before_any_resume_decision(finished, tmp_path, how, capsys):
    out = fresh(finished, tmp_path)
    before = samples(out)
    idx = out / "index.jsonl"
    {"deleted": idx.unlink, "emptied": lambda: idx.write_bytes(b""),
     "shortened": lambda: write_lines(out, lines(out)[: N // 3])}[how]()  # fmt: skip
    with pytest.raises(CorruptFile, match="lost lines.*repair"):
        ShardReader(out)
    code, text = cli("export", "--to", "specforge", out, tmp_path / "ex", capsys=capsys)
    assert code == 2 and "lost lines" in text and not (tmp_path / "ex").exists()
    assert any("lost lines" in p for p in verify(out))
    counts = resume(tmp_path, limit=3)  # an input that holds only a few of them
    assert counts["ok_this_run"] == 0 and verify(out) == [] and samples(out) == before


# 4 ---------------------------------------------------------------------------------------------
def first_and_last(out):
    recs = lines(out)
    shard = max({r["shard"] for r in recs}, key=lambda s: sum(r["shard"] == s for r in recs))
    mine = sorted((r for r in recs if r["shard"] == shard), key=lambda r: r["offset"])
    assert len(mine) >= 3
    return mine


def truncate_last(out, mine):
    with open(out / "shards" / mine[-1]["shard"], "r+b") as f:
        f.truncate(mine[-1]["offset"] + mine[-1]["length"] - 1024)


def flip_first_header(out, mine):
    p = out / "shards" / mine[0]["shard"]
    b = bytearray(p.read_bytes())
    b[12] ^= 0x40  # inside frame A's first block: its header no longer decodes
    p.write_bytes(bytes(b))


def flip_last_header(out, mine):
    p = out / "shards" / mine[-1]["shard"]
    b = bytearray(p.read_bytes())
    b[mine[-1]["offset"] + 12] ^= 0x40
    p.write_bytes(bytes(b))


def edit_first_id(out, mine):
    recs = lines(out)
    for r in recs:
        if r["id"] == mine[0]["id"]:
            r["id"] = "0" * 24
    write_lines(out, recs)


@pytest.mark.parametrize("damage", [truncate_last, flip_first_header, flip_last_header, edit_first_id])
def test_one_damaged_record_at_a_shards_start_or_end_costs_at_most_that_record(finished, tmp_path, damage):
    out = fresh(finished, tmp_path)
    before, mine = samples(out), first_and_last(out)
    damage(out, mine)
    size = (out / "shards" / mine[0]["shard"]).stat().st_size
    resume(tmp_path, limit=2)  # an input that holds neither damaged record
    after = samples(out)
    hit = {mine[0]["id"], mine[-1]["id"]}
    assert {i: v for i, v in before.items() if i not in hit} == {i: v for i, v in after.items() if i not in hit}
    assert all(after.get(i, v) == v for i, v in before.items())  # what is served is what was stored
    assert (out / "shards" / mine[0]["shard"]).stat().st_size == size  # not a byte cut
    assert verify(out) == []
    resume(tmp_path)  # the whole input: what was lost is redone
    assert set(samples(out)) == set(before) and verify(out) == []


# 5 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "bf16", "cuda"])
def test_a_dtype_the_format_does_not_hold_is_refused_before_the_output_folder_is_opened(tmp_path, dtype):
    from recipe.schema import ConfigError

    with pytest.raises(ConfigError, match="bfloat16 activations only"):
        run(cfg(tmp_path, f"model.dtype={dtype}", limit=2))
    assert not (tmp_path / "out").exists()


# 6 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("link", [".lock", "shards", "one shard", "index.jsonl"])
def test_nothing_is_written_through_a_symbolic_link(finished, tmp_path, link):
    out = fresh(finished, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(finished, other)
    (tmp_path / "precious").write_text("the user's file")
    first = sorted((out / "shards").glob("shard-*.bin"))[0].name
    target, to = {".lock": (out / ".lock", tmp_path / "precious"), "shards": (out / "shards", other / "shards"),
                  "one shard": (out / "shards" / first, other / "shards" / first),
                  "index.jsonl": (out / "index.jsonl", other / "index.jsonl")}[link]  # fmt: skip
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(to)
    theirs = samples(other)
    with pytest.raises(UserError, match="symbolic link"):
        resume(tmp_path, limit=2)
    assert (tmp_path / "precious").read_text() == "the user's file"
    assert verify(other) == [] and samples(other) == theirs


# 7 ---------------------------------------------------------------------------------------------
def two_turns(i):
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


@pytest.mark.parametrize("shape", ["jsonl whose first line is an array", "a truncated array", "a trailing comma"])
def test_every_record_is_a_sample_or_a_counted_skip_whatever_the_first_bytes(tmp_path, shape):
    from test_data import dcfg

    from recipe import data
    from recipe.models import make_tokenizer

    recs = [json.dumps(two_turns(i)) for i in range(5)]
    text = {
        "jsonl whose first line is an array": "[1, 2]\n" + "\n".join(recs) + "\n",
        "a truncated array": "[\n" + ",\n".join(recs) + ",\n" + recs[0][:20] + "\n",
        "a trailing comma": "[\n" + ",\n".join(recs) + ",\n]\n",
    }[shape]
    p = tmp_path / "in.json"
    p.write_text(text)
    plan = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer())
    assert len(plan.samples) == 5  # every whole record is read
    assert len(plan.samples) + sum(plan.skipped.values()) == plan.input  # and the rest is counted
    assert sum(plan.skipped.values()) == (0 if shape == "a trailing comma" else 1)


# 8 ---------------------------------------------------------------------------------------------
def test_a_lost_identity_never_lets_other_settings_in(finished, tmp_path):
    from recipe.shards.store import ProvenanceMismatch

    out = fresh(finished, tmp_path)
    before = samples(out)
    (out / "identity.json").unlink()
    with pytest.raises(ProvenanceMismatch, match="max_length"):
        resume(tmp_path, "data.max_length=77")
    assert not (out / "identity.json").exists()
    assert resume(tmp_path)["ok_this_run"] == 0  # its own command still resumes it
    assert (out / "identity.json").exists() and samples(out) == before


def test_the_records_own_slots_outrank_an_edited_manifest(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    m["capture"]["layers"], m["capture"]["slots"] = [2, 3], ["layer_2", "layer_3", "final_post_norm"]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptFile, match="capture disagrees"):
        ShardReader(out)
    assert verify(out) != []
    code, text = cli("export", "--to", "speculators", out, tmp_path / "ex", capsys=capsys)
    assert code == 2 and len(text.strip().splitlines()) == 1


# 9 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{}, 1, "drop crc32", "string offset", "not json"])
def test_a_malformed_index_line_is_one_line_everywhere_and_a_resume_mends_it(finished, tmp_path, bad, capsys):
    out = fresh(finished, tmp_path)
    before = samples(out)
    recs = lines(out)
    text = [json.dumps(r) for r in recs]
    if bad == "drop crc32":
        del recs[4]["crc32"]
        text[4] = json.dumps(recs[4])
    elif bad == "string offset":
        text[4] = json.dumps({**recs[4], "offset": str(recs[4]["offset"])})
    else:
        text[4] = "{not json" if bad == "not json" else json.dumps(bad)
    (out / "index.jsonl").write_text("\n".join(text) + "\n")
    with pytest.raises(CorruptFile, match="line 5"):
        ShardReader(out)
    assert len(verify(out)) == 1
    code, text_out = cli("export", "--to", "specforge", out, tmp_path / "ex", capsys=capsys)
    assert code == 2 and len(text_out.strip().splitlines()) == 1
    assert resume(tmp_path)["ok_this_run"] == 0  # the record itself is indexed again
    assert verify(out) == [] and samples(out) == before


LINE = {"id": "0" * 24, "key": "k", "shard": "shard-00000.bin", "offset": 0, "length": 9, "tokens": 4,
        "raw_bytes": 64, "crc32": 7, "loss_tokens": 3}  # fmt: skip
MALFORMED = {
    "a field missing": lambda r: {k: v for k, v in r.items() if k != "crc32"},
    "a bool for an int": lambda r: {**r, "tokens": True},
    "a float for an int": lambda r: {**r, "length": 9.0},
    "an int for a string": lambda r: {**r, "id": 5},
    "null": lambda r: {**r, "key": None},
    "a negative offset": lambda r: {**r, "offset": -1},
    "an empty record": lambda r: {**r, "length": 0},
    "a shard in another folder": lambda r: {**r, "shard": "../shard-00000.bin"},
    "a shard that is not one": lambda r: {**r, "shard": "index.jsonl"},
    "an array": lambda r: list(r),
    "not JSON": lambda r: Unreadable("{not json"),
}


@pytest.mark.parametrize("bad", MALFORMED)
def test_a_long_index_judged_at_once_refuses_exactly_the_lines_judged_one_by_one(bad):
    lines = [{**LINE, "id": f"{i:024x}", "offset": 9 * i} for i in range(2000)]
    assert repair.problems(lines) == {}
    lines[1234] = MALFORMED[bad](lines[1234])
    why = repair.line_problem(lines[1234])
    assert why is not None and repair.problems(lines) == {1234: why}


@pytest.mark.parametrize("edit", ["key", "id of another sample", "tokens"])
def test_an_edited_index_field_is_mended_from_the_record(finished, tmp_path, edit):
    out = fresh(finished, tmp_path)
    before = samples(out)
    recs = lines(out)
    mid = next(i for i in range(1, len(recs) - 1) if recs[i - 1]["shard"] == recs[i]["shard"] == recs[i + 1]["shard"])
    if edit == "key":
        recs[mid]["key"] = "f" * 32
    elif edit == "tokens":
        recs[mid]["tokens"] += 1
    else:
        recs[mid]["id"] = recs[0]["id"]
    write_lines(out, recs)
    assert verify(out) != []
    counts = resume(tmp_path, *(["shards.deep_check=true"] if edit == "tokens" else []))
    assert counts["ok_this_run"] == 0 and verify(out) == [] and samples(out) == before


def test_a_deleted_shard_is_one_line_in_the_reader_and_export(finished, tmp_path, capsys):
    from recipe.shards.codec import CorruptRecord

    out = fresh(finished, tmp_path)
    rec = lines(out)[0]
    (out / "shards" / rec["shard"]).unlink()
    with pytest.raises(CorruptRecord, match="missing"):
        ShardReader(out).get(rec["id"])
    code, text = cli("export", "--to", "specforge", out, tmp_path / "ex", capsys=capsys)
    assert code == 2 and "missing" in text and "Traceback" not in text


def test_a_manifest_of_the_wrong_shape_is_one_line(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    (out / "manifest.json").write_text("{}")
    with pytest.raises(CorruptFile, match="manifest.json lacks"):
        ShardReader(out)
    assert len(verify(out)) == 1
    for cmd in (("inspect", out), ("export", "--to", "specforge", out, tmp_path / "ex")):
        code, text = cli(*cmd, capsys=capsys)
        assert code == 2 and len(text.strip().splitlines()) == 1


# 10 --------------------------------------------------------------------------------------------
def test_verify_says_what_garbage_after_a_shard_is_and_the_resume_leaves_it(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    shard = sorted((out / "shards").glob("shard-*.bin"))[0]
    with open(shard, "ab") as f:
        f.write(b"not a record of ours")
    said = io.StringIO()
    assert verify(out, out=said) == []  # every sample is whole: the bytes are named, never "repaired"
    assert "are not a record (left as they are" in said.getvalue()
    size = shard.stat().st_size
    resume(tmp_path)
    assert shard.stat().st_size == size and verify(out) == []


def test_merge_refuses_a_damaged_input_and_verify_names_the_merged_sets_own_fix(finished, tmp_path, capsys):
    a = fresh(finished, tmp_path)
    b = tmp_path / "b"
    shutil.copytree(finished, b)
    rec = lines(b)[2]
    p = b / "shards" / rec["shard"]
    data = bytearray(p.read_bytes())
    data[rec["offset"] + rec["length"] - 5] ^= 1
    p.write_bytes(bytes(data))
    code, text = cli("merge", tmp_path / "m", a, b, capsys=capsys)
    assert code == 2 and "crc32 mismatch" in text and not (tmp_path / "m" / "index.jsonl").exists()
    c = tmp_path / "c"
    shutil.copytree(finished, c)
    assert cli("merge", tmp_path / "m2", a, c)[0] == 0
    merged = tmp_path / "m2"
    gone = lines(merged)[0]["shard"]
    (merged / "shards" / gone).unlink()
    assert any("the job that made them redoes them" in p for p in verify(merged))


def test_inspect_counts_what_the_index_holds(finished, tmp_path, capsys):
    out = fresh(finished, tmp_path)
    write_lines(out, lines(out) + [])  # the same index; the manifest's copy edited below
    m = json.loads((out / "manifest.json").read_text())
    m["totals"]["tokens"] += 1000
    (out / "manifest.json").write_text(json.dumps(m))
    cli("inspect", out, capsys=capsys)
    code = shards_cli(["inspect", "--json", str(out)])
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["samples"] == N and info["tokens"] == sum(r["tokens"] for r in lines(out))


# 11 --------------------------------------------------------------------------------------------
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] }})</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_record(content):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    return {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": content, "tool_calls": [call]},
                         {"role": "tool", "content": "12 C", "tool_call_id": "1"},
                         {"role": "assistant", "content": "It is 12 C."}]}  # fmt: skip


@pytest.mark.parametrize("content", [None, ""])
def test_tool_calls_train_on_what_the_template_renders_or_are_refused_saying_why(tmp_path, content):
    from test_data import dcfg

    from recipe import data
    from recipe.models import make_tokenizer

    p = tmp_path / "tools.jsonl"
    p.write_text(json.dumps(tool_record(content)) + "\n" + json.dumps(two_turns(0)) + "\n")
    tok = make_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    plan = data.build_plan(dcfg(sources=[str(p)]), tok)
    assert len(plan.samples) == 2 and not plan.skipped
    s = plan.samples[0]
    trained = tok.decode(s.input_ids[s.loss_mask.astype(bool)])
    assert "get_weather" in trained and "Oslo" in trained and "It is 12 C." in trained
    plain = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer())  # a template that drops tool_calls
    assert len(plain.samples) == 1 and plain.skipped == {"template_drops_tool_calls": 1}
