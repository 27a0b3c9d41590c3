"""The inputs a user really has: a folder of files, Parquet, a DatasetDict's split, the OpenAI list form
of content, tools, a cut compressed file, an array after whitespace or a BOM. Each is read as the plain
JSONL of the same conversations would be, or refused in one line naming it."""

import gzip
import json
import lzma

import pytest
import zstandard
from test_data import dcfg

from recipe import data
from recipe.errors import UserError
from recipe.models import make_tokenizer

SRC = data.ASSETS / "tiny-chat.jsonl"
ROWS = [json.loads(x) for x in SRC.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ids(tok, *sources, **kw):
    plan = data.build_plan(dcfg(sources=[str(s) for s in sources], max_failures=0, **kw), tok)
    return [s.id for s in plan.samples]


def test_a_folder_of_jsonl_files_is_read_in_name_order(tmp_path, tok):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[20:]))
    (tmp_path / "d" / "a.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS[:20]).encode())
    )
    assert ids(tok, tmp_path / "d") == ids(tok, SRC)


def test_parquet_is_read_as_its_rows(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_json(str(SRC)).to_parquet(str(tmp_path / "c.parquet"))
    assert ids(tok, tmp_path / "c.parquet") == ids(tok, SRC)


def test_a_file_that_is_not_parquet_is_refused_by_name(tmp_path, tok):
    pytest.importorskip("pyarrow")
    (tmp_path / "c.parquet").write_text(SRC.read_text())
    with pytest.raises(UserError, match="not a readable Parquet file"):
        ids(tok, tmp_path / "c.parquet")


def test_a_dataset_dict_reads_the_named_split_and_names_the_rest(tmp_path, tok, caplog):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_json(str(SRC))
    datasets.DatasetDict({"train": one.select(range(5)), "test": one.select(range(5, 40))}).save_to_disk(
        str(tmp_path / "hf")
    )
    with caplog.at_level("INFO"):
        assert len(ids(tok, tmp_path / "hf")) == 5
    assert "left out ['test']" in caplog.text
    assert ids(tok, tmp_path / "hf", split="test") == ids(tok, SRC)[5:]
    with pytest.raises(UserError, match="no split 'validation'"):
        ids(tok, tmp_path / "hf", split="validation")


@pytest.mark.parametrize("suffix", [".gz", ".xz", ".zst"])
def test_a_cut_compressed_input_is_one_line_naming_it(tmp_path, tok, suffix):
    raw = SRC.read_bytes()
    packed = {".gz": gzip.compress, ".xz": lzma.compress, ".zst": zstandard.ZstdCompressor().compress}[suffix](raw)
    path = tmp_path / f"c.jsonl{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(UserError, match="cut short or damaged") as e:
        ids(tok, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("lead", [" \n\t  \n", "\ufeff", "\ufeff\n  ", " \n" * 100])
def test_a_json_array_after_whitespace_or_a_bom_is_read_as_an_array(tmp_path, tok, lead):
    (tmp_path / "c.json").write_text(lead + json.dumps(ROWS, indent=1), encoding="utf-8")
    assert ids(tok, tmp_path / "c.json") == ids(tok, SRC)


def test_content_as_a_list_of_text_parts_reads_as_its_text(tmp_path, tok):
    def parts(text):
        return [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]

    parted = [
        {**r, "messages": [{**m, "content": parts(m["content"])} for m in r["messages"]]} if "messages" in r else r
        for r in ROWS
    ]
    assert sum("messages" in r for r in ROWS) > 10
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in parted))
    assert ids(tok, tmp_path / "p.jsonl") == ids(tok, SRC)


def test_a_non_text_content_part_is_refused_by_name():
    with pytest.raises(data.BadRecord, match="non_text_content"):
        data.openai_message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


def test_null_content_without_tool_calls_is_refused_by_name_never_read_as_empty():
    rec = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "an answer"}]}
    with pytest.raises(data.BadRecord, match="^null_content"):
        data.to_messages(rec)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]  # fmt: skip


def test_tools_are_tokenized_as_the_template_renders_them(tmp_path):
    from recipe.models import common, llama

    tools_first = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    )
    tok = common.tokenizer(llama.SPECIALS, tools_first + llama.TEMPLATES["chatml"])  # renders `tools` as Qwen's does
    msgs = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is sunny."}]
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": msgs, "tools": TOOLS}) + "\n")
    plan = data.build_plan(dcfg(sources=[str(tmp_path / "t.jsonl")], max_failures=0), tok)
    want = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert plan.samples[0].input_ids.tolist() == list(want)
    assert "get_weather" in tok.decode(plan.samples[0].input_ids)
