"""Guarantees at their edges: each test checks a promise over its whole boundary (both ends of a
range, N and N+1 of a limit, every field of a schema), so that any bug breaking the promise fails
it, not only the one bug that prompted it. Each has a mutation in tests/mutate.py.
"""

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import compose
from omegaconf import OmegaConf
from test_data import dcfg

from recipe import data
from recipe.models import make_tokenizer


def jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def conv(user: str, *answers: str) -> dict:
    msgs = [{"role": "user", "content": user}]
    for a in answers:
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": "and?"}]
    return {"messages": msgs[:-1] if answers else msgs}


# -- every stored sample trains on a non-empty assistant turn -----------------------------------
@pytest.mark.parametrize("answers", [("",), ("", ""), ("", " ")])
def test_a_conversation_whose_assistant_turns_are_all_empty_is_never_a_sample(tmp_path, answers):
    p = jsonl(tmp_path / "d.jsonl", [conv("hi", *answers), conv("ok", "fine")])
    plan = data.build_plan(dcfg(sources=[str(p)]), make_tokenizer())
    assert len(plan.samples) == 1 and plan.skipped["no_assistant_turn"] + plan.skipped["no_loss_tokens"] == 1


def test_every_stored_samples_loss_tokens_come_from_non_empty_assistant_content(tmp_path):
    tok = make_tokenizer()
    recs = [conv("q", "", "an answer"), conv("p", "x", ""), conv("r", "", "", "last")]
    plan = data.build_plan(dcfg(sources=[str(jsonl(tmp_path / "d.jsonl", recs))]), tok)
    assert len(plan.samples) == 3
    for s in plan.samples:
        trained = tok.decode(s.input_ids[s.loss_mask.astype(bool)])
        assert trained.replace("<|im_end|>", "").strip(), trained  # more than end-of-turn markers


# -- policy skips never count as invalid input ----------------------------------------------------
@pytest.mark.parametrize("policy", ["duplicate", "too_long", "no_loss_tokens"])
def test_policy_skips_never_count_against_max_failures(tmp_path, policy):
    recs = [conv(f"q{i}", f"a{i}") for i in range(3)]
    if policy == "duplicate":
        recs += [conv("q0", "a0")] * 30
    elif policy == "too_long":
        recs += [conv(f"long {i}", "x" * 400) for i in range(30)]
    else:  # the assistant turn lies past max_length: nothing left to train on after truncation
        recs += [conv(f"u{i} " + "y" * 300, "late") for i in range(30)]
    p = jsonl(tmp_path / "d.jsonl", recs)
    plan = data.build_plan(dcfg(sources=[str(p)], max_failures=0, max_length=120, overflow="skip"
                                if policy == "too_long" else "truncate"), make_tokenizer())  # fmt: skip
    assert len(plan.samples) == 3 and plan.skipped[policy] == 30


# -- every limit holds exactly at its boundary ------------------------------------------------------
class DeadServer:
    """A server that is always dead: every ensure_up restarts it."""

    proc = SimpleNamespace(returncode=1)

    def alive(self):
        return False

    def log_tail(self, n=40):
        return "dead"

    def stop(self, grace_s=0):
        pass

    def start(self):
        pass

    def wait_ready(self):
        return 0.0


@pytest.mark.parametrize("n", [0, 1, 3])
def test_max_restarts_allows_exactly_n_restarts(tmp_path, n):
    from recipe.backends.sglang import ServerError, Supervisor

    opts = SimpleNamespace(launch=True, max_restarts=n, health_every_s=1, health_timeout_s=1, health_misses=1)
    sup = Supervisor(DeadServer(), opts, "http://127.0.0.1:9", tmp_path)

    async def deaths(k: int) -> None:
        sup.lock = asyncio.Lock()  # the client's loop makes it
        for _ in range(k):
            await sup.ensure_up()

    asyncio.run(deaths(n))
    with pytest.raises(ServerError, match=f"max_restarts={n}"):
        asyncio.run(deaths(1))
    assert sup.restarts == n


@pytest.mark.parametrize("n", [1, 5, 12])
def test_max_failures_accepts_exactly_n_invalid_records(tmp_path, n):
    good = [conv(f"q{i}", f"a{i}") for i in range(3)]
    for bad, ok in ((n, True), (n + 1, False)):
        p = jsonl(tmp_path / f"d{bad}.jsonl", good + [{"nonsense": i} for i in range(bad)])
        cfg = dcfg(sources=[str(p)], max_failures=n)
        if ok:
            assert len(data.build_plan(cfg, make_tokenizer()).samples) == 3
        else:
            with pytest.raises(data.DataError, match=f"{bad} of"):
                data.build_plan(cfg, make_tokenizer())


def test_max_length_keeps_exactly_max_length_tokens(tmp_path):
    tok = make_tokenizer()
    p = jsonl(tmp_path / "d.jsonl", [conv("hello", "a reply of some length"), conv("k", "ok")])
    n = len(data.build_plan(dcfg(sources=[str(p)]), tok).samples[0].input_ids)
    assert len(data.build_plan(dcfg(sources=[str(p)], max_length=n, overflow="skip"), tok).samples) == 2
    short = data.build_plan(dcfg(sources=[str(p)], max_length=n - 1, overflow="skip"), tok)
    assert len(short.samples) == 1 and short.skipped["too_long"] == 1
    cut = data.build_plan(dcfg(sources=[str(p)], max_length=n - 1), tok).samples[0]
    assert len(cut.input_ids) == n - 1 and cut.truncated


# -- every capture layer lies within the residual stream ------------------------------------------
@pytest.mark.parametrize(
    "backend,layers,ok",
    [("hf", [0], True), ("hf", [3], True), ("hf", [4], False), ("hf", [-1], False),
     ("sglang", [1], True), ("sglang", [3], True), ("sglang", [0], False), ("sglang", [4], False)],
)  # fmt: skip
def test_every_capture_layer_is_a_residual_stream_input_at_both_ends(backend, layers, ok):
    """On a 4-layer model: index i is the input of layer i, 0 <= i < 4 (1 <= i on SGLang, which adds
    the residual); i = 4 would be HF's hidden_states[4], the post-norm final state, not an input."""
    from recipe import schema

    cfg = compose([f"backend={backend}", "output_dir=/tmp/o", f"capture.layers={layers}"])
    if ok:
        schema.check_layers(cfg, 4)
    else:
        with pytest.raises(schema.ConfigError, match="layer"):
            schema.check_layers(cfg, 4)


# -- every setting that changes a sample is in the identity ---------------------------------------
# Each leaf of the schema, by what it does to the stored bytes of a sample. A new setting fails the
# test below until it is placed here, so none can be left out of the identity by forgetting it.
CHANGES_A_SAMPLE = {
    "data.max_length", "data.overflow", "data.shard_index", "data.num_shards", "data.chat_template_kwargs",
    "data.split",
    "capture.layers", "capture.final", "capture.convention",
}  # fmt: skip
THROUGH_ITS_INPUTS = {  # in the identity through what they name: the files' hashes
    "model.path": "the model fingerprint and the tokenizer hashes",
    "model.trust_remote_code": "the tokenizer's remote code, hashed",
    "data.sources": "each source's sha256",
    "model.num_layers": "checked against config.json, which the fingerprint hashes",
    "model.hidden_size": "likewise",
    "model.dtype": "refused unless bfloat16, the only dtype the format holds",
    "model.default_layers": "the default of capture.layers",
    "capture.spread": "the layers it spreads, set as capture.layers before the identity is made",
    **{
        f"data.regenerate.{k}": "in the identity once turns is not off (tests/test_regenerate.py)"
        for k in ("turns", "temperature", "top_p", "max_new_tokens", "seed", "cut")
    },
}
LEAVES_NOTHING = {  # how a set is made, or where: the samples stay the same samples
    "model.name", "data.limit", "data.max_failures", "capture.dump_dir",
    "capture.budget_gb", "capture.rid_prefix", "capture.dump_timeout_s", "capture.writer_queue",
    "capture.writer_threads", "output_dir", "dry_run", "log_every_s", "data.regenerate.concurrency",
}  # fmt: skip
GROUPS_OF_THEIR_OWN = ("backend", "server", "client", "nccl", "shards", "hydra")  # runtime: see below


def schema_leaves(cls, prefix=""):
    for f in fields(cls):
        t = f.type if not isinstance(f.type, str) else None
        default = f.default_factory() if f.default_factory is not Ellipsis and callable(f.default_factory) else None
        sub = t if is_dataclass(t) else (type(default) if is_dataclass(default) else None)
        if sub is not None:
            yield from schema_leaves(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


FLIPS = {"data.overflow": "skip", "data.shard_index": "1", "capture.layers": "[1,2]",
          "capture.convention": "other"}  # fmt: skip


def flipped(key: str):
    """The default config with `key` set to another value (composed as a user's override is)."""
    v = OmegaConf.select(compose(["output_dir=/tmp/o"]), key)
    v = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
    if key in FLIPS:
        new = FLIPS[key]
    elif isinstance(v, bool):
        new = str(not v).lower()
    elif isinstance(v, (int, float)):
        new = str(v + 1)
    elif isinstance(v, list):
        new = "[1]"
    else:
        new = f"{v}x" if v else "7"
    extra = ["data.num_shards=2"] if key == "data.shard_index" else []
    if key == "data.chat_template_kwargs":  # a dict of the user's own keys: a new key is added with +
        return compose(["output_dir=/tmp/o", "+data.chat_template_kwargs.thinking=false"])
    return compose(["output_dir=/tmp/o", f"{key}={new}", *extra])


def test_every_setting_that_changes_a_sample_is_in_the_identity():
    from recipe.provenance import identity
    from recipe.schema import Config

    cfg = compose(["output_dir=/tmp/o"])
    leaves = {k for k in schema_leaves(Config) if k.split(".")[0] not in GROUPS_OF_THEIR_OWN}
    placed = CHANGES_A_SAMPLE | set(THROUGH_ITS_INPUTS) | LEAVES_NOTHING
    assert leaves <= placed, f"settings placed nowhere: {sorted(leaves - placed)}"

    def ident(c):
        return identity(c, "fp", {"sha256": "t"}, [{"source": "s", "sha256": "h"}])

    base = ident(cfg)
    for key in sorted(CHANGES_A_SAMPLE):
        assert ident(flipped(key)) != base, f"{key} changes a sample but not the identity"
    for key in sorted(LEAVES_NOTHING & leaves):
        assert ident(flipped(key)) == base, f"{key} is in the identity but leaves a sample as it is"


def test_the_runtime_groups_change_no_sample():
    """backend, server, client, nccl and shards say how a set is made: none is in the identity."""
    from recipe.provenance import identity

    ids = {json.dumps(identity(compose(o), "fp", {}, []), sort_keys=True)
           for o in (["output_dir=/tmp/o"], ["output_dir=/tmp/o", "shards.zstd_level=9", "shards.workers=3",
                     "shards.max_shard_gb=1", "backend.batch_size=2", "nccl=infiniband"])}  # fmt: skip
    assert len(ids) == 1


# -- the recipe signals only a process it started ---------------------------------------------------
def test_a_stale_server_record_never_kills_a_process_that_reused_its_pid(tmp_path):
    from recipe.backends.sglang import Server, proc_start_time

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        pid_file = tmp_path / ".server.json"
        start = int(proc_start_time(other.pid))
        pid_file.write_text(json.dumps({"pid": other.pid, "start": str(start - 1)}))  # the pid, another process
        Server(["true"], None, tmp_path / "log", "http://127.0.0.1:9", 1, pid_file).reap_leftover()
        time.sleep(0.2)
        assert other.poll() is None, "an unrelated process under a stale pid was killed"
        pid_file.write_text(json.dumps({"pid": other.pid, "start": str(start)}))  # the very process
        Server(["true"], None, tmp_path / "log", "http://127.0.0.1:9", 1, pid_file).reap_leftover()
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)


# -- every atomic replace is followed by an fsync of its folder -------------------------------------
def test_every_replace_of_a_file_the_recipe_owns_is_made_durable_by_its_folders_fsync(tmp_path, monkeypatch):
    from conftest import small_run_cfg

    from recipe.main import run
    from recipe.shards import store as store_mod

    events, real_replace, real_fsync = [], os.replace, os.fsync

    def replace(a, b):
        real_replace(a, b)
        events.append(("replace", str(Path(b).resolve())))

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "replace", replace)
    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    run(small_run_cfg(tmp_path, "shards.max_shard_gb=0.0002", limit=6))
    lines = (tmp_path / "out" / "index.jsonl").read_text().splitlines()
    (tmp_path / "out" / "index.jsonl").write_text("\n".join(lines + lines[:1]) + "\n")  # the resume rewrites it
    run(small_run_cfg(tmp_path, "shards.max_shard_gb=0.0002", limit=6))
    replaced = {Path(p).name for kind, p in events if kind == "replace"}
    assert {"identity.json", "manifest.json", "NEXT", "index.jsonl"} <= replaced
    for i, (kind, path) in enumerate(events):
        if kind == "replace":
            later = [p for k, p in events[i + 1 :] if k == "fsync"]
            assert later and later[0] == str(Path(path).parent), f"{path}: its folder is not fsynced next"


# -- the sample is always the rendered conversation's first max_length tokens ---------------------
def long_token_tokenizer(words: list[str]):
    """A WordLevel tokenizer whose tokens are whole long words (a cut inside one gives [UNK]), with
    the tiny model's chat template: a stand-in for a vocabulary of long tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, "user": 3, "assistant": 4, "q": 5}
    vocab.update({w: i + len(vocab) for i, w in enumerate(words)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])  # fmt: skip
    fast.chat_template = make_tokenizer().chat_template
    return fast


@pytest.mark.parametrize("word_len", [24, 30, 31, 32, 33, 40])
def test_the_sample_is_the_whole_conversations_first_max_length_tokens_around_the_cut(word_len):
    """Words of about CHARS_PER_TOKEN_BOUND characters, one token each: the cut before tokenizing
    falls inside a word near the max_length-th token. Over a sweep of max_length, the sample's ids
    and mask are the first max_length of the whole conversation's."""
    rng = np.random.default_rng(word_len)
    words = ["".join(rng.choice(list("abcdefghij"), word_len)) for _ in range(50)]
    tok = long_token_tokenizer(words)
    answer = " ".join(words[i % 50] for i in range(700))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
    full_ids, full_mask = data.tokenize(tok, msgs)
    for max_length in range(1, 600, 7):
        ids, mask = data.tokenize_within(tok, msgs, dcfg(sources=[], max_length=max_length))
        assert np.array_equal(ids[:max_length], full_ids[:max_length]), max_length
        assert np.array_equal(mask[:max_length], full_mask[:max_length]), max_length


# -- merge and resume refuse the same identity differences ------------------------------------------
def leaves(d: dict, path=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, (*path, k))
        else:
            yield (*path, k)


def test_merge_and_resume_refuse_exactly_the_same_identity_differences():
    """Over every field of a real identity, each changed in turn: a resume refuses every change
    (identity_diff), and a merge (merge.differences) refuses the same ones, but the job's share of
    the data (which records a job took)."""
    import copy

    from recipe.provenance import identity
    from recipe.shards.merge import JOB_SPLIT, differences
    from recipe.shards.store import identity_diff

    tok = {"sha256": "t", "files": {"tokenizer.json": "a", "chat_template.jinja": "b"}, "remote_code": None,
           "chat_template_sha256": "b"}  # fmt: skip
    cfg = compose(["output_dir=/tmp/o", "+data.chat_template_kwargs.thinking=false"])
    base = identity(cfg, "fp", tok, [{"source": "s", "sha256": "h"}])
    fields_seen = sorted(leaves(base))
    names = {".".join(p) for p in fields_seen}
    assert {"tokenizer.chat_template_sha256", "data.overflow", "data.max_length", "capture.layers"} <= names
    for keys in fields_seen:
        other, path = copy.deepcopy(base), ".".join(keys)
        node = other
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = ["changed"] if node[keys[-1]] != ["changed"] else ["other"]
        split = any(path == k or path.startswith(k + ".") for k in JOB_SPLIT)
        assert identity_diff(base, other), f"a resume accepts another {path}"
        assert bool(differences(base, other)) == (not split), f"merge and resume disagree on {path}"
