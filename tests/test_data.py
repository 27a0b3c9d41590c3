"""Input -> samples: formats, loss-mask boundaries, truncation, splitting and accounting."""

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipe import data
from recipe.models import make_tokenizer


def dcfg(**kw):
    """A data config node as the schema types it (recipe.schema.DataConfig), with these values."""
    from recipe.schema import DataConfig

    return OmegaConf.merge(OmegaConf.structured(DataConfig), {"sources": [], "max_failures": 1000, **kw})


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "More?"},
    {"role": "assistant", "content": "Sure."},
]


@pytest.mark.parametrize(
    "template,header,end",
    [
        ("chatml", "<|im_start|>assistant\n", "<|im_end|>"),
        ("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ],
)
def test_loss_mask_boundaries(template, header, end):
    tok = make_tokenizer(template)
    ids, mask = data.tokenize(tok, CONV)
    pieces = [tok.decode([int(i)]) for i in ids]
    trained = "".join(p for p, m in zip(pieces, mask) if m)
    assert trained == f"Hello there{end}Sure.{end}"
    # boundaries, token by token: the role markers before each answer are not trained, its first token is
    text = "".join(pieces)
    for answer in ("Hello there", "Sure."):
        pos = text.index(header + answer)
        # index of the first token of the answer
        acc, first = 0, None
        for j, p in enumerate(pieces):
            if acc == pos + len(header):
                first = j
                break
            acc += len(p)
        assert first is not None
        assert mask[first] == 1 and pieces[first] == answer[0]
        assert mask[first - 1] == 0  # the last token of the assistant header
        hdr_tokens = len(tok(header, add_special_tokens=False)["input_ids"])
        assert not mask[first - hdr_tokens : first].any()
    # user and system text is never trained
    assert "Hi" not in trained and "Be brief" not in trained
    # the newline after the end-of-turn marker is not trained
    last = int(np.nonzero(mask)[0][-1])
    assert pieces[last] == end


def test_formats_agree(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"prompt": "a", "completion": "b"},
    ]
    msgs = [data.to_messages(r) for r in rows]
    assert msgs[0] == msgs[1] == msgs[2]
    assert len({data.sample_id(m) for m in msgs}) == 1


def write_lines(path, lines):
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def good(i, n=3):
    return json.dumps(
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x" * n + str(i)}]}
    )


def test_accounting_with_bad_lines(tmp_path):
    tok = make_tokenizer()
    p = write_lines(
        tmp_path / "d.jsonl",
        [
            good(0),
            "{not json",
            b"\xff\xfe bad utf8",
            json.dumps([1, 2]),
            json.dumps({"text": "hi"}),
            json.dumps({"messages": "nope"}),
            json.dumps({"messages": []}),
            json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
            json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}),
            good(0),
            good(1, n=5000),
            "",
            good(2),
        ],
    )
    plan = data.build_plan(dcfg(sources=[str(p)], max_length=200, overflow="skip"), tok)
    assert plan.input == 12  # the blank line is not a record
    assert len(plan.samples) == 2
    assert dict(plan.skipped) == {
        "invalid_json": 1,
        "invalid_utf8": 1,
        "not_an_object": 1,
        "missing_field": 1,
        "bad_field_type": 1,
        "empty_conversation": 1,
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "duplicate": 1,
        "too_long": 1,
    }
    assert len(plan.samples) + sum(plan.skipped.values()) == plan.input
    assert plan.examples["invalid_json"][0].startswith("d.jsonl:2")


def test_max_failures_stops_the_run(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [good(0), "{bad", "{bad2", good(1)])
    with pytest.raises(data.DataError, match="2 of 4 input records are invalid"):
        data.build_plan(dcfg(sources=[str(p)], max_failures=1), make_tokenizer())
    with pytest.raises(data.DataError, match="2 of 4 input records are invalid"):
        data.build_plan(dcfg(sources=[str(p)], max_failures=0), make_tokenizer())
    assert len(data.build_plan(dcfg(sources=[str(p)], max_failures=2), make_tokenizer()).samples) == 2
    # a fraction has a floor: one or two bad lines never refuse a small file...
    assert len(data.build_plan(dcfg(sources=[str(p)], max_failures=0.01), make_tokenizer()).samples) == 2
    # ...but a mostly broken large one is refused
    big = write_lines(tmp_path / "big.jsonl", [good(i) for i in range(20)] + ["{bad"] * 11)
    with pytest.raises(data.DataError, match="11 of 31"):
        data.build_plan(dcfg(sources=[str(big)], max_failures=0.01), make_tokenizer())


def test_empty_input_is_an_error(tmp_path):
    p = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(data.DataError, match="no input records"):
        data.build_plan(dcfg(sources=[str(p)]), make_tokenizer())


def test_an_input_with_no_valid_record_is_an_error_whatever_its_size(tmp_path):
    """Fewer invalid records than the max_failures floor still refuse a run that has nothing to do."""
    p = write_lines(tmp_path / "bad.jsonl", ["{bad", json.dumps([json.loads(good(0))]), '{"messages": null}'])
    with pytest.raises(data.DataError, match="no valid record among the 3 input records: invalid_json 1"):
        data.build_plan(dcfg(sources=[str(p)], max_failures=0.01), make_tokenizer())


def test_a_record_of_exactly_max_length_tokens_is_kept_whole(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [good(0, n=50)])
    tok = make_tokenizer()
    n = len(data.build_plan(dcfg(sources=[str(p)]), tok).samples[0].input_ids)
    kept = data.build_plan(dcfg(sources=[str(p)], max_length=n, overflow="skip"), tok)
    assert len(kept.samples) == 1 and len(kept.samples[0].input_ids) == n and not kept.samples[0].truncated
    assert not kept.skipped
    with pytest.raises(data.DataError, match="too_long 1"):  # one token less: the policy skips it
        data.build_plan(dcfg(sources=[str(p)], max_length=n - 1, overflow="skip"), tok)


def test_records_that_differ_only_in_reasoning_are_distinct_samples_or_a_counted_duplicate(tmp_path):
    """reasoning_content is part of the sample's identity (a template that renders it trains another
    target); under one that does not render it, both records give the same tokens: the second is a
    counted duplicate, never a second sample with the same key (which the store refuses)."""
    a = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]}
    b = json.loads(json.dumps(a))
    b["messages"][1]["reasoning_content"] = "think first"
    assert data.sample_id(data.to_messages(a)) != data.sample_id(data.to_messages(b))
    p = write_lines(tmp_path / "d.jsonl", [json.dumps(a), json.dumps(b), good(1)])
    plan = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer("chatml"))  # renders no reasoning
    assert len(plan.samples) == 2 and plan.skipped == {"duplicate": 1}
    assert "the same tokens as an earlier record" in plan.examples["duplicate"][0]


def test_samples_are_frozen_with_their_resume_key_set_as_they_are_built(tmp_path):
    import dataclasses

    p = tmp_path / "d.jsonl"
    p.write_text(
        "".join(
            json.dumps({"messages": CONV[:3] + [{"role": "user", "content": str(i)}] + CONV[3:]}) + "\n"
            for i in range(3)
        )
    )
    plan = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer(), key_of=lambda ids: f"k{len(ids)}-{ids[-1]}")
    assert [s.key for s in plan.samples] == [f"k{len(s.input_ids)}-{s.input_ids[-1]}" for s in plan.samples]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.samples[0].key = "another"


def test_roles_case_insensitive_and_bom(tmp_path):
    rows = [
        {"messages": [{"role": "User", "content": "a"}, {"role": "ASSISTANT", "content": "b"}]},
        {"conversations": [{"from": "HUMAN", "value": "a"}, {"from": "GPT", "value": "b"}]},
    ]
    assert data.to_messages(rows[0]) == data.to_messages(rows[1])
    p = write_lines(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + good(0).encode(), good(1)])
    plan = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer())
    assert len(plan.samples) == 2 and not plan.skipped


def test_no_input_crashes_the_plan(tmp_path):
    """A fuzzed reader: every record becomes a sample or a counted skip, whatever it holds."""
    import random

    def msg(c):
        return json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": c}]})

    nasty = [
        msg("\ud800"),
        msg("a\udfffb"),
        msg("nul\u0000inside"),
        "\x00\x00",
        "[" * 100_000 + "]" * 100_000,
        "{" * 5000,
        msg("x" * 2_000_000),
        json.dumps({"messages": [{"role": 1, "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": {"a": 1}}]}),
        json.dumps({"prompt": None}),
        json.dumps({"prompt": "q", "completion": ["x"]}),
        json.dumps({"conversations": [None]}),
        json.dumps({"messages": [None, 3]}),
        "null",
        "3",
        '"str"',
        "true",
        "\ufeff\ufeff{}",
        good(7),
    ]
    rng = random.Random(0)
    for _ in range(300):  # byte-level mutations of a good record
        b = bytearray(good(rng.randrange(1000)).encode())
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        nasty.append(bytes(b))
    p = write_lines(tmp_path / "fuzz.jsonl", nasty)
    plan = data.build_plan(dcfg(sources=[str(p)], max_failures=10_000), make_tokenizer())
    lines = sum(1 for x in p.read_bytes().split(b"\n") if x.strip())
    assert plan.input == lines and len(plan.samples) + sum(plan.skipped.values()) == plan.input
    assert plan.skipped["invalid_unicode"] == 2 and plan.skipped["invalid_json"] >= 2
    assert any(s.source == "fuzz.jsonl:19" for s in plan.samples)  # the good record among them


def test_truncate_keeps_the_prefix(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [good(0, n=500)])
    tok = make_tokenizer()
    full = data.build_plan(dcfg(sources=[str(p)]), tok).samples[0]
    cut = data.build_plan(dcfg(sources=[str(p)], max_length=100), tok).samples[0]
    assert len(cut.input_ids) == 100 and cut.truncated
    assert np.array_equal(cut.input_ids, full.input_ids[:100]) and np.array_equal(cut.loss_mask, full.loss_mask[:100])


def test_job_split_partitions_the_input(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [good(i) for i in range(10)] + ["{bad"])
    tok = make_tokenizer()
    whole = data.build_plan(dcfg(sources=[str(p)], limit=9), tok)
    parts = [data.build_plan(dcfg(sources=[str(p)], limit=9, shard_index=k, num_shards=3), tok) for k in range(3)]
    assert sorted(s.id for pt in parts for s in pt.samples) == sorted(s.id for s in whole.samples)
    assert sum(pt.input for pt in parts) == whole.input == 9
    for k, pt in enumerate(parts):  # the documented rule: record i goes to job i % num_shards
        assert [s.source for s in pt.samples] == [f"d.jsonl:{i + 1}" for i in range(9) if i % 3 == k]


def test_compressed_lines_json_arrays_and_stdin_read_as_the_plain_file(tmp_path):
    """The bundled conversations in every form a user has them: .jsonl.gz, .jsonl.zst, one JSON array,
    and piped through stdin."""
    import gzip
    import subprocess
    import sys

    import zstandard

    from recipe.data import ASSETS

    src = ASSETS / "tiny-chat.jsonl"
    raw = src.read_bytes()
    rows = [json.loads(x) for x in raw.splitlines() if x.strip()]
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    tok = make_tokenizer()

    def ids(source):
        plan = data.build_plan(dcfg(sources=[str(source)], max_failures=0), tok)
        return [s.id for s in plan.samples]

    want = ids(src)
    assert len(want) == len(rows)
    for name in ("c.jsonl.gz", "c.jsonl.zst", "c.json"):
        assert ids(tmp_path / name) == want, name
    probe = (
        "import sys, json; from recipe import data; from recipe.models import make_tokenizer; "
        "from tests.test_data import dcfg; "
        "p = data.build_plan(dcfg(sources=['/dev/stdin'], max_failures=0), make_tokenizer()); "
        "print(json.dumps([s.id for s in p.samples]))"
    )
    from conftest import ROOT

    r = subprocess.run([sys.executable, "-c", probe], input=raw, capture_output=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout) == want


def test_a_local_hf_dataset_gives_the_same_samples_as_its_jsonl(tmp_path):
    """Arrow fills the columns a row lacks with null. Its own test, so that a missing `datasets`
    skips this check alone."""
    datasets = pytest.importorskip("datasets")
    src = data.ASSETS / "tiny-chat.jsonl"
    datasets.Dataset.from_json(str(src)).save_to_disk(str(tmp_path / "hf"))  # columns unified: nulls
    tok = make_tokenizer()
    plans = [data.build_plan(dcfg(sources=[str(p)], max_failures=0), tok) for p in (src, tmp_path / "hf")]
    assert [s.id for s in plans[1].samples] == [s.id for s in plans[0].samples] and plans[0].samples


def huge_record(n_chars: int) -> str:
    words = [f"w{i % 977}" for i in range(n_chars // 4)]
    return json.dumps({"messages": [{"role": "user", "content": "a short question"},
                                    {"role": "assistant", "content": " ".join(words)[:n_chars]}]})  # fmt: skip


def test_a_huge_message_is_cut_before_tokenizing_and_keeps_the_whole_texts_first_tokens(tmp_path, monkeypatch):
    """One 1 MB message at max_length 300: only a bounded prefix is ever tokenized, and the sample is
    the whole text's first 300 tokens (loss mask included); under overflow=skip it is counted too long."""
    p = write_lines(tmp_path / "d.jsonl", [huge_record(1_000_000), good(0)])
    tok = make_tokenizer()
    seen, real = [], data.assistant_spans
    monkeypatch.setattr(data, "assistant_spans", lambda *a: seen.append(len(real(*a)[0])) or real(*a))
    s = data.build_plan(dcfg(sources=[str(p)], max_length=300), tok).samples[0]
    assert max(seen) < 20_000, seen  # (300 + margin) x 32 characters, not the megabyte
    ids, mask = data.tokenize(tok, json.loads(p.read_text().splitlines()[0])["messages"])
    assert s.truncated and np.array_equal(s.input_ids, ids[:300]) and np.array_equal(s.loss_mask, mask[:300])
    skipped = data.build_plan(dcfg(sources=[str(p)], max_length=300, overflow="skip"), tok)
    assert dict(skipped.skipped) == {"too_long": 1} and len(skipped.samples) == 1


def test_text_whose_tokens_are_longer_than_the_cut_assumes_is_tokenized_whole(tmp_path, monkeypatch):
    """If the cut text gives too few tokens to prove the cut harmless, the whole text decides."""
    p = write_lines(tmp_path / "d.jsonl", [huge_record(50_000)])
    tok = make_tokenizer()
    monkeypatch.setattr(data, "CHARS_PER_TOKEN_BOUND", 0.01)  # as if tokens were 100x longer than assumed
    s = data.build_plan(dcfg(sources=[str(p)], max_length=300), tok).samples[0]
    ids, mask = data.tokenize(tok, json.loads(p.read_text())["messages"])
    assert np.array_equal(s.input_ids, ids[:300]) and np.array_equal(s.loss_mask, mask[:300])
