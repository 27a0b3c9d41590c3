"""Input -> the plan: tokenized samples with an assistant-only loss mask, plus exact accounting.

Accepted records (JSONL, or a local HF dataset saved with `save_to_disk`):
  {"messages": [{"role": ..., "content": ...}, ...]}          OpenAI style
  {"conversations": [{"from": "human"|"gpt"|..., "value": ...}]}  ShareGPT
  {"prompt": "...", "completion"|"response": "..."}              single turn
Every input record ends up in exactly one bucket: planned, or skipped under a named reason.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from . import sources
from .errors import UserError

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
ROLES = {"system", "user", "assistant", "tool"}


class BadRecord(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class DataError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Sample:
    id: str  # content hash of the conversation: stable across runs, machines and job splits
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]: 1 on tokens the draft is trained to predict (assistant turns)
    source: str  # "file:line"
    key: str = ""  # resume key: hash of (model, capture, token ids), set by build_plan's key_of
    truncated: bool = False
    conversation: tuple | None = None  # (messages, tools) while the target is still to rewrite it


@dataclass
class Plan:
    samples: list[Sample] = field(default_factory=list)
    input: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=lambda: collections.defaultdict(list))
    sources: list[dict] = field(default_factory=list)

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if len(self.examples[reason]) < 5:
            self.examples[reason].append(f"{where}: {detail}" if detail else where)

    @property
    def tokens(self) -> int:
        return int(sum(len(s.input_ids) for s in self.samples))


# -- reading --------------------------------------------------------------------------------
def resolve_source(src: str) -> Path:
    if src.startswith("builtin:"):
        p = ASSETS / f"{src.split(':', 1)[1]}.jsonl"
        if not p.exists():
            raise DataError(f"no built-in dataset {src!r} (have: {sorted(x.stem for x in ASSETS.glob('*.jsonl'))})")
        return p
    p = Path(src).expanduser()
    if not p.exists():
        raise DataError(f"data source {src!r} does not exist")
    return p


def spooled(path: Path) -> Path:
    """A pipe or device (`/dev/stdin`, a FIFO) read once into a temporary file: the plan reads a
    source twice (its checksum, then its records), and a stream gives its bytes only once."""
    if path.is_file() or path.is_dir():
        return path
    fd, tmp = tempfile.mkstemp(prefix="hs-recipe-input-", suffix="".join(path.suffixes))
    atexit.register(os.unlink, tmp)  # the copy lives as long as the run that read it
    with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return Path(tmp)


def open_text_lines(path: Path):
    """The file's bytes, decompressed by its suffix (.gz, .zst, .xz), as a binary stream."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".xz":
        return lzma.open(path, "rb")
    if path.suffix == ".zst":
        return io.BufferedReader(sources.ZstdWhole(path))
    return open(path, "rb")


CUT = (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError)  # a compressed file cut short


def json_array(path: Path) -> list | None:
    """The records of a file that holds one JSON array (`[{...}, {...}]`), else None: read as JSON
    lines, each line a record or a counted failure (a JSONL file whose first line is an array, or an
    array cut short or with a trailing comma, is then counted line by line, never read as empty)."""
    try:
        with open_text_lines(path) as f:
            head = f.peek(1 << 16)[: 1 << 16].lstrip(b"\xef\xbb\xbf \t\r\n")
            if not head.startswith(b"["):
                return None
            try:
                text = f.read().decode("utf-8").lstrip("\ufeff")
            except UnicodeDecodeError:
                return None
    except CUT as e:
        raise sources.cut_short(path, e, 0) from None
    try:
        data = json.loads(text)
    except RecursionError:
        return None
    except json.JSONDecodeError:
        return open_array(text)
    return data if isinstance(data, list) else None


def open_array(text: str) -> list | None:
    """A JSON array that never closes (cut short) or has a trailing comma: its whole elements, then
    one BadRecord for what follows the last of them; None where the array closes and more follows
    (a JSONL file whose first line is an array), which is read line by line."""
    i, out, dec = text.index("[") + 1, [], json.JSONDecoder()

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    while True:
        i = skip(i)
        if i < len(text) and text[i] == "]":
            return out if skip(i + 1) == len(text) else None
        try:
            obj, i = dec.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            return out + [
                BadRecord("invalid_json", f"the array is cut short or malformed after {len(out)} records: {e}")
            ]
        out.append(obj)
        i = skip(i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i >= len(text) or text[i] != "]":
            return out + [BadRecord("invalid_json", f"the array is cut short after {len(out)} records")]


def iter_records(path: Path, name: str | None = None, split: str = "train"):
    """Yields (where, record-or-BadRecord). Never raises for a bad line: the plan counts it; a file
    that cannot be read on (cut short) is one line. `name`: how `where` names the source (the path's
    name by default); `split`: a saved DatasetDict's split."""
    name = name or path.name
    if path.is_dir():
        if sources.is_hf_dataset(path):
            yield from sources.hf_rows(path, name, split)
            return
        for f in sources.folder_files(path):  # a folder of files, read in name order
            yield from iter_records(f, f"{name}/{f.name}", split)
        return
    if path.suffix == ".parquet":
        yield from sources.parquet_rows(path, name)
        return
    records = json_array(path)
    if records is not None:
        for n, rec in enumerate(records, 1):
            yield f"{name}[{n - 1}]", rec
        return
    yield from json_lines(path, name)


def json_lines(path: Path, name: str):
    """A JSONL file's records, a line each; a compressed file cut short is one line naming it."""
    n = 0
    try:
        with open_text_lines(path) as f:
            for n, raw in enumerate(f, 1):
                where = f"{name}:{n}"
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8").lstrip("\ufeff")  # a BOM: first line, or files concatenated
                except UnicodeDecodeError as e:
                    yield where, BadRecord("invalid_utf8", str(e))
                    continue
                try:
                    yield where, json.loads(text)
                except (json.JSONDecodeError, RecursionError) as e:  # deep nesting is not JSON we can use
                    yield where, BadRecord("invalid_json", f"{type(e).__name__}: {str(e)[:200]}")
    except CUT as e:
        raise sources.cut_short(path, e, n) from None


def to_messages(rec, answers_optional: bool = False) -> list[dict]:
    """A record's conversation. answers_optional: a record with no answer is kept (data.regenerate:
    the target writes it)."""
    if not isinstance(rec, dict):
        raise BadRecord("not_an_object", type(rec).__name__)
    rec = {k: v for k, v in rec.items() if v is not None}  # Arrow fills a column a row lacks with null
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list):
            raise BadRecord("bad_field_type", "messages is not a list")
        out = [openai_message(m) for m in msgs]
    elif "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list):
            raise BadRecord("bad_field_type", "conversations is not a list")
        out = []
        for m in conv:
            if not isinstance(m, dict) or not isinstance(m.get("from"), str) or not isinstance(m.get("value"), str):
                raise BadRecord("bad_field_type", "each turn needs string 'from' and 'value'")
            if m["from"].lower() not in SHAREGPT_ROLES:
                raise BadRecord("unknown_role", m["from"])
            out.append({"role": SHAREGPT_ROLES[m["from"].lower()], "content": m["value"]})
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise BadRecord("bad_field_type", "prompt is not a string")
        out = [{"role": "user", "content": rec["prompt"]}]
        answer = rec.get("completion", rec.get("response"))
        if answer is not None:
            if not isinstance(answer, str):
                raise BadRecord("bad_field_type", "completion is not a string")
            out.append({"role": "assistant", "content": answer})
    else:
        raise BadRecord("missing_field", f"no messages/conversations/prompt (keys: {sorted(rec)[:6]})")
    if not out:
        raise BadRecord("empty_conversation")
    answered = any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in out)
    if not answered and not answers_optional:
        raise BadRecord("no_assistant_turn")
    for m in out:  # valid JSON can hold lone surrogates ("\ud800"), which no tokenizer can encode
        try:
            (m["content"] + m.get("reasoning_content", "")).encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord("invalid_unicode", str(e)) from None
    return out


TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # passed to the template as the OpenAI form has them


def openai_message(m) -> dict:
    """One message of the `messages` form, checked. An assistant turn may carry `tool_calls` with
    `content` null or empty (the OpenAI form): the template renders the call, and that is what the
    draft trains on (see template_renders)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRecord("bad_field_type", "each message needs string 'role' and 'content'")
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise BadRecord("bad_field_type", "tool_calls is not a list of objects")
    content = m.get("content")
    if content is None and not calls:  # never read as "": an answer would be trained without its question
        raise BadRecord("null_content", f"a {m['role']} message's content is null and it has no tool_calls")
    if content is None:
        content = ""
    if isinstance(content, list):
        content = text_parts(content)
    if not isinstance(content, str):
        raise BadRecord("bad_field_type", "each message needs string 'role' and 'content'")
    if m["role"].lower() not in ROLES:
        raise BadRecord("unknown_role", m["role"])
    msg = {"role": m["role"].lower(), "content": content}
    if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
        msg["reasoning_content"] = m["reasoning_content"]  # thinking models' templates render it
    for k in TOOL_KEYS:
        if m.get(k):
            msg[k] = m[k]
    return msg


def text_parts(parts: list) -> str:
    """OpenAI's list form of `content` ([{"type": "text", "text": ...}, ...]) as the one string it
    stands for; any other part (an image, audio) is refused by name: the text model never saw it."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRecord("non_text_content", f"a content part of type {kind!r}")
    return "".join(texts)


def record_tools(rec) -> list | None:
    """A record's `tools` (function schemas the template renders into the prompt), or None."""
    tools = rec.get("tools") if isinstance(rec, dict) else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRecord("bad_field_type", "tools is not a list of objects")
    return tools or None


def template_renders(tokenizer, msgs: list[dict], tools, kwargs: dict) -> None:
    """A conversation with tool calls or tools is trained on only where the chat template renders
    them: a template that drops them would train the draft on a turn without its call."""
    with_tools = {**kwargs, "tools": tools} if tools else kwargs
    full = render(tokenizer, msgs, False, with_tools)
    if any("tool_calls" in m for m in msgs):
        no_calls = [{k: v for k, v in m.items() if k != "tool_calls"} for m in msgs]
        if render(tokenizer, no_calls, False, with_tools) == full:
            raise BadRecord("template_drops_tool_calls", "this model's chat template does not render tool_calls")
    if tools and render(tokenizer, msgs, False, kwargs) == full:
        raise BadRecord("template_drops_tools", "this model's chat template does not render tools")


def sample_id(messages: list[dict], tools=None) -> str:
    canon = json.dumps(
        [[m["role"], m["content"]] + ([m["reasoning_content"]] if "reasoning_content" in m else [])
         + [[k, m[k]] for k in TOOL_KEYS if k in m] for m in messages] + ([["tools", tools]] if tools else []),
        ensure_ascii=False,
        separators=(",", ":"),
        sort_keys=True,
    )  # fmt: skip
    return hashlib.sha256(canon.encode()).hexdigest()[:24]


# -- tokenizing -----------------------------------------------------------------------------
def render(tokenizer, messages, add_generation_prompt: bool, template_kwargs=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )


def turn_end_marker(tokenizer, template_kwargs=None) -> str:
    """What the template writes after an assistant turn's content (e.g. `<|im_end|>`), read off a
    one-turn rendering: the end of a turn in a rendering that rewrote it (see assistant_spans). The probe
    is a private-use character, not whitespace: templates that `trim` the content (Llama-3's, Gemma's)
    would strip a control character away."""
    probe = "\ue000"
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}]
    text = render(tokenizer, msgs, False, template_kwargs)
    return text[text.rindex(probe) + len(probe) :].rstrip()


def assistant_spans(tokenizer, messages, template_kwargs=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the draft is trained on.

    A span runs from just after the template's assistant header (the text the template adds for
    add_generation_prompt) to the end of that turn, end-of-turn marker included, trailing
    whitespace excluded. Template-agnostic, as long as the rendering up to each assistant header is
    a prefix of the whole (checked: otherwise the record is skipped, never given a shifted mask).
    Templates that rewrite a turn once later turns follow (Kimi-K2.5 and other thinking models drop
    earlier reasoning) are handled: such a turn is taken as rendered in the whole conversation, up
    to the template's end-of-turn marker.
    """
    full = render(tokenizer, messages, False, template_kwargs)
    spans, marker = [], None
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:k], True, template_kwargs)
        upto = render(tokenizer, messages[: k + 1], False, template_kwargs)
        if not full.startswith(head) or not upto.startswith(head):
            raise BadRecord("template_not_prefix_stable", f"turn {k}")
        if full.startswith(upto):
            end = len(upto)
        else:  # this turn is rendered differently once later turns follow: find its end in `full`
            marker = marker if marker is not None else turn_end_marker(tokenizer, template_kwargs)
            at = full.find(marker, len(head)) if marker else -1
            if at < 0:
                raise BadRecord("template_not_prefix_stable", f"turn {k}: no end-of-turn marker")
            end = at + len(marker)
        while end > len(head) and full[end - 1].isspace():
            end -= 1
        spans.append((len(head), end))
    return full, spans


def tokenize(tokenizer, messages, template_kwargs=None) -> tuple[np.ndarray, np.ndarray]:
    text, spans = assistant_spans(tokenizer, messages, template_kwargs)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask
    return tokenize_by_pieces(tokenizer, text, spans)


def tokenize_by_pieces(tokenizer, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
    """Slow (Python) tokenizers, such as Kimi's tiktoken class, give no character offsets: tokenize
    the text piece by piece at the span edges instead. The edges sit at the template's special
    tokens, so the pieces tokenize as the whole does; that is checked, never assumed."""
    cuts = sorted({0, len(text), *(x for span in spans for x in span)})
    ids, mask = [], []
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer.encode(text[a:b], add_special_tokens=False)
        ids += piece
        mask += [int(any(s <= a and b <= e for s, e in spans))] * len(piece)
    if ids != tokenizer.encode(text, add_special_tokens=False):
        raise BadRecord("token_boundary_unstable", "a loss-mask edge falls inside a token")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def build_plan(data_cfg, tokenizer, log_every_s: float = 10.0, key_of=None) -> Plan:
    """Every record of every source read, rendered and tokenized, each a Sample (with its resume key,
    key_of(input_ids), when given) or a counted skip."""
    plan = Plan()
    seen_ids: set[str] = set()
    seen_tokens: dict[bytes, str] = {}  # records that differ only in what the template does not render
    for where, rec in my_records(data_cfg, plan, log_every_s):
        try:
            s = to_sample(rec, where, tokenizer, data_cfg, seen_ids, seen_tokens)
        except BadRecord as e:
            plan.skip(e.reason, where, str(e))
            continue
        except Exception as e:  # no input may crash the plan: anything unforeseen is a counted skip
            plan.skip("unreadable_record", where, f"{type(e).__name__}: {str(e)[:200]}")
            continue
        seen_ids.add(s.id)
        plan.samples.append(dataclasses.replace(s, key=key_of(s.input_ids)) if key_of else s)
    check_plan(plan, data_cfg)
    return plan


def my_records(data_cfg, plan: Plan, log_every_s: float):
    """(where, record) of every source in order, this job's share of them (data.shard_index of
    data.num_shards, by position over all sources) up to data.limit; counts plan.input and says how
    far it got every log_every_s (tokenizing a large file takes minutes)."""
    t0 = last = time.monotonic()
    index = 0  # position over all records of all sources: decides limit and job split
    for src in data_cfg.sources:
        path = spooled(resolve_source(src))
        plan.sources.append({"source": src, "path": str(path), "sha256": file_sha256(path)})
        for where, rec in iter_records(path, Path(src).name, data_cfg.split):
            if data_cfg.limit is not None and index >= data_cfg.limit:
                return
            mine = index % data_cfg.num_shards == data_cfg.shard_index
            index += 1
            if not mine:
                continue
            plan.input += 1
            if time.monotonic() - last > log_every_s:
                last = time.monotonic()
                rate = plan.input / (last - t0)
                log.info("reading %s: %d records (%.0f/s), %d samples", src, plan.input, rate, len(plan.samples))
            yield where, rec


# Characters per token that a conversation's first max_length tokens are assumed not to exceed on
# average: a message is cut there before tokenizing, so one huge record costs bounded time and memory.
# Text past the cut only ever reaches tokens past max_length (checked: if the cut text does not give
# more than max_length + CUT_MARGIN tokens, the whole text is tokenized after all).
CHARS_PER_TOKEN_BOUND = 32
CUT_MARGIN = 64


def cut_messages(msgs: list[dict], budget: int) -> tuple[list[dict], bool]:
    """The conversation up to `budget` characters of content: the message that crosses it cut there,
    later ones dropped. Returns (messages, whether anything was cut)."""
    out = []
    for m in msgs:
        content = m.get("content")
        if not isinstance(content, str) or len(content) <= budget:
            out.append(m)
            budget -= len(content) if isinstance(content, str) else 0
            continue
        out.append({**m, "content": content[:budget]})
        return out, True
    return out, False


def tokenize_within(tokenizer, msgs: list[dict], data_cfg, tools=None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask whose first max_length tokens equal the whole conversation's, without
    tokenizing text that cannot reach them. `tools`: the record's, rendered by the template."""
    short, cut = cut_messages(msgs, int((data_cfg.max_length + CUT_MARGIN) * CHARS_PER_TOKEN_BOUND))
    kwargs = dict(data_cfg.chat_template_kwargs or {})
    try:
        if tools or any("tool_calls" in m for m in msgs):
            template_renders(tokenizer, msgs, tools, kwargs)
            kwargs = {**kwargs, "tools": tools} if tools else kwargs
        ids, mask = tokenize(tokenizer, short, kwargs)
        if cut and len(ids) <= data_cfg.max_length + CUT_MARGIN:  # unusually long tokens: the whole text
            ids, mask = tokenize(tokenizer, msgs, kwargs)
    except BadRecord:
        raise
    except Exception as e:  # a template that cannot render this conversation
        raise BadRecord("template_error", f"{type(e).__name__}: {e}") from None
    return ids, mask


def to_sample(rec, where: str, tokenizer, data_cfg, seen_ids: set, seen_tokens: dict) -> Sample:
    """One record as a Sample, or the BadRecord that says why it is skipped."""
    if isinstance(rec, BadRecord):
        raise rec
    regenerate = data_cfg.regenerate.turns != "off"  # the target writes the answers (recipe/regenerate.py)
    msgs, tools = to_messages(rec, answers_optional=regenerate), record_tools(rec)
    sid = sample_id(msgs, tools)
    if sid in seen_ids:
        raise BadRecord("duplicate", f"same content as an earlier record (id {sid})")
    ids, mask = tokenize_within(tokenizer, msgs, data_cfg, tools)
    truncated = len(ids) > data_cfg.max_length
    if truncated:
        if data_cfg.overflow == "skip":
            raise BadRecord("too_long", f"{len(ids)} > max_length {data_cfg.max_length}")
        ids, mask = ids[: data_cfg.max_length], mask[: data_cfg.max_length]
    if not mask.any() and not regenerate:
        raise BadRecord("no_loss_tokens", "no assistant token left" + (" after truncation" if truncated else ""))
    same = seen_tokens.setdefault(hashlib.sha256(ids.tobytes()).digest(), sid)
    if same != sid:
        raise BadRecord("duplicate", f"the same tokens as an earlier record (id {same})")
    return Sample(sid, ids, mask, where, truncated=truncated, conversation=(msgs, tools) if regenerate else None)


def check_plan(plan: Plan, data_cfg) -> None:
    """No input, no valid record, or more invalid ones than data.max_failures allows: a DataError."""
    if plan.input == 0:
        raise DataError(
            f"no input records in {', '.join(map(str, data_cfg.sources))}"
            + (f" for job {data_cfg.shard_index} of {data_cfg.num_shards}" if data_cfg.num_shards > 1 else "")
        )
    invalid = sum(v for k, v in plan.skipped.items() if k not in POLICY_SKIPS)
    if not plan.samples:  # whatever the input's size: nothing to extract is never a success
        reasons = ", ".join(f"{r} {n} (e.g. {plan.examples[r][0]})" for r, n in plan.skipped.items())
        raise DataError(f"no valid record among the {plan.input} input records: {reasons}")
    if invalid > failure_limit(data_cfg.max_failures, plan.input):
        lines = "\n".join(
            f"  {r}: {n}  e.g. {plan.examples[r][0]}" for r, n in plan.skipped.items() if r not in POLICY_SKIPS
        )
        raise DataError(
            f"{invalid} of {plan.input} input records are invalid (data.max_failures={data_cfg.max_failures}):\n{lines}"
        )


def failure_limit(max_failures: float, n_input: int) -> float:
    """How many invalid records a run accepts: max_failures >= 1 is a count; below 1 a fraction of
    the input, but never fewer than FRACTION_FLOOR records, so one bad line never refuses a small file.
    0 accepts none."""
    if max_failures >= 1 or max_failures == 0:
        return max_failures
    return max(max_failures * n_input, FRACTION_FLOOR)


FRACTION_FLOOR = 10
# skips that follow from config, not from broken input: they never count against max_failures
POLICY_SKIPS = {"too_long", "duplicate", "no_loss_tokens"}


def file_sha256(path: Path, limit: int | None = None) -> str:
    """sha256 of a file (its first `limit` bytes, if given) or of a directory's files and names."""
    h = hashlib.sha256()
    if limit is not None:
        with open(path, "rb") as f:
            h.update(f.read(limit))
    elif path.is_dir():
        for f in sorted(path.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(path).as_posix().encode())
                h.update(f.read_bytes())
    else:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def sample_key(model_fingerprint: str, capture: dict, ids: np.ndarray) -> str:
    h = hashlib.sha256(model_fingerprint.encode())
    h.update(json.dumps(capture, sort_keys=True).encode())
    h.update(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
    return h.hexdigest()[:32]
