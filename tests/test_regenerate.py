"""data.regenerate: the target rewrites the assistant turns and the capture prefills what it wrote, with the
exact ids it generated, a mask over exactly those, a file a resume reuses, and an identity of its own."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, small_run_cfg

from recipe import data
from recipe.backends.hf import load_causal_lm
from recipe.errors import UserError
from recipe.main import run
from recipe.regenerate import FILE, stop_token, turn_seed
from recipe.shards import ShardReader

LAST = ["data.regenerate.turns=last", "data.regenerate.max_new_tokens=16", "data.max_length=4096"]  # none cut


def rows(out, kind: str) -> list[dict]:
    return [json.loads(x)[kind] for x in (out / FILE).read_text().splitlines() if kind in json.loads(x)]


def conversations(tokenizer, cfg) -> dict:
    """The records' conversations as the plan reads them, by sample id."""
    return {s.id: s.conversation for s in data.build_plan(cfg.data, tokenizer).samples}


def test_stored_ids_are_the_prompts_ids_then_the_generated_ids_and_only_those_are_trained(tmp_path, tokenizer):
    cfg = small_run_cfg(tmp_path, *LAST, limit=4)
    assert run(cfg)["ok"] == 4
    r, turns = ShardReader(tmp_path / "out"), {t["id"]: t for t in rows(tmp_path / "out", "turn")}
    model = load_causal_lm(r.manifest["model"]["path"], torch.bfloat16)
    convs = conversations(tokenizer, cfg)
    for sid in r.ids:
        x, t = r.get(sid), turns[sid]
        msgs, _ = convs[sid]
        prompt = tokenizer.encode(data.render(tokenizer, msgs[: t["message"]], True), add_special_tokens=False)
        assert x["input_ids"].tolist() == prompt + t["generated"]  # never the generated text re-tokenized
        assert x["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(t["generated"])
        torch.manual_seed(turn_seed(0, sid, t["message"]))  # what the model itself writes with that turn's seed
        again = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=True, temperature=0.7,
                               top_p=0.95, top_k=None, eos_token_id=stop_token(tokenizer), pad_token_id=0)  # fmt: skip
        assert again[0, len(prompt) :].tolist() == t["generated"]


def built_in_templates() -> dict:
    """Every built-in family's chat template on its byte tokenizer, and Llama-3's (the draft bench's)."""
    from recipe.models import FAMILIES, llama

    out = {f.__name__.rsplit(".", 1)[-1]: (f.SPECIALS, f.TEMPLATE, getattr(f, "NAMED", None))
           for f in FAMILIES if hasattr(f, "TEMPLATE")}  # fmt: skip
    return {**out, "llama3": (llama.SPECIALS, llama.LLAMA3, None)}


NO_TURN_END = {"glm4_moe", "glm5"}  # GLM's next header ends a turn: no token of its own


@pytest.mark.parametrize("name", sorted(built_in_templates()))
def test_regeneration_stops_at_the_token_each_built_in_template_ends_a_turn_with(name):
    from recipe.models import common

    tok = common.tokenizer(*built_in_templates()[name])
    if name in NO_TURN_END:
        with pytest.raises(UserError, match="not one token"):
            stop_token(tok)
        return
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": " hello "}]  # trimmed by some
    ids = tok.encode(data.render(tok, msgs, False).rstrip(), add_special_tokens=False)
    assert stop_token(tok) == ids[-1]
    assert tok.convert_ids_to_tokens(ids[-1]) in tok.all_special_tokens


def ends_each_turn(monkeypatch, n: int = 5):
    """The backend's generate answering n bytes from the seed, then the template's end of turn (a tiny
    random model rarely ends a turn: this one always does, so that every turn of a record is written)."""
    from recipe.backends.hf import HFBackend

    def generate(self, prompt, seed, regen, stop):
        return [int(b) for b in np.random.default_rng(seed).integers(97, 122, n)] + [stop]

    monkeypatch.setattr(HFBackend, "generate", generate)


def test_all_turns_are_written_turn_by_turn_each_prompt_the_stored_ids_so_far(tmp_path, tokenizer, monkeypatch):
    ends_each_turn(monkeypatch)
    cfg = small_run_cfg(tmp_path, "data.regenerate.turns=all", "data.max_length=4096", limit=6)
    assert run(cfg)["ok"] == 6
    r, turns = ShardReader(tmp_path / "out"), rows(tmp_path / "out", "turn")
    convs, multi = conversations(tokenizer, cfg), 0
    for sid in r.ids:
        x, mine = r.get(sid), [t for t in turns if t["id"] == sid]
        ids, mask = x["input_ids"].tolist(), x["loss_mask"].tolist()
        assistant = [k for k, m in enumerate(convs[sid][0]) if m["role"] == "assistant"]
        assert [t["message"] for t in mine] == assistant and all(t["finished"] for t in mine)
        trained = [i for i, m in zip(ids, mask) if m]
        assert trained == [i for t in mine for i in t["generated"]]  # every turn's ids, in order, nothing else
        multi += len(mine) > 1
        conv = next(c for c in rows(tmp_path / "out", "conversation") if c["id"] == sid)
        assert conv["input_ids"] == ids and data.render(tokenizer, conv["messages"], False).count("<|im_end|>") >= 2
    assert multi  # the bundled data has conversations of several assistant turns


def patched_run(tmp_path, patch: str, args: list) -> subprocess.CompletedProcess:
    """`python -m recipe ARGS` in a process whose HF backend is patched by the line `patch`."""
    script = f"import os, signal, sys\nfrom recipe.backends.hf import HFBackend\n{patch}\n"
    script += "sys.argv = ['recipe', *sys.argv[1:]]\nimport recipe.__main__\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_a_resume_after_a_kill_between_regeneration_and_capture_writes_no_turn_again(tmp_path):
    """kill -9 once every turn is in the file and nothing is stored; the resume rebuilds each sample
    from the file (its generate fails if called) and stores exactly those ids."""
    args = [*LAST, f"output_dir={tmp_path / 'out'}", f"capture.dump_dir={tmp_path / 'shm'}", "data.limit=4"]
    crash = "HFBackend.run = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)"
    assert patched_run(tmp_path, crash, args).returncode == -9
    turns = {t["id"]: t for t in rows(tmp_path / "out", "turn")}
    assert len(turns) == 4 and not list((tmp_path / "out").glob("shards/*.bin"))
    twice = "HFBackend.generate = lambda *a, **k: (_ for _ in ()).throw(AssertionError('a turn generated twice'))"
    p = patched_run(tmp_path, twice, args)
    assert p.returncode == 0, p.stderr[-2000:]
    r = ShardReader(tmp_path / "out")
    assert sorted(r.ids) == sorted(turns)
    for sid in r.ids:
        assert r.get(sid)["input_ids"].tolist()[-len(turns[sid]["generated"]) :] == turns[sid]["generated"]


def test_a_torn_last_line_is_written_again_and_the_file_goes_on_whole(tmp_path):
    assert run(small_run_cfg(tmp_path, *LAST, limit=2))["ok"] == 2
    path = tmp_path / "out" / FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # a crash mid-line
    assert run(small_run_cfg(tmp_path, *LAST, limit=3))["ok"] == 3
    assert all(json.loads(x) for x in path.read_bytes().splitlines())  # every line whole


def test_regenerated_and_original_answers_never_share_a_set(tmp_path):
    from recipe.shards.store import ProvenanceMismatch

    assert run(small_run_cfg(tmp_path, limit=2))["ok"] == 2  # the answers as given
    for other in (LAST, [*LAST, "data.regenerate.temperature=0.2"]):
        with pytest.raises(ProvenanceMismatch, match="regenerate"):
            run(small_run_cfg(tmp_path, *other, limit=2))
    assert run(small_run_cfg(tmp_path / "r", *LAST, limit=2))["ok"] == 2
    with pytest.raises(ProvenanceMismatch, match="temperature"):  # and two settings never share one either
        run(small_run_cfg(tmp_path / "r", *LAST, "data.regenerate.temperature=0.2", limit=2))


def test_every_regeneration_setting_is_in_the_identity_once_it_is_on():
    from conftest import compose

    from recipe.provenance import identity

    def ident(*o):
        return identity(compose(["output_dir=/tmp/o", *o]), "fp", {}, [])

    assert ident() == ident("data.regenerate.temperature=0.1")  # off: the answers as given, settings unused
    on = ident("data.regenerate.turns=last")
    assert on != ident()
    for flip in ("turns=all", "temperature=0.1", "top_p=0.5", "max_new_tokens=7", "seed=3", "cut=skip"):
        assert ident("data.regenerate.turns=last", f"data.regenerate.{flip}") != on, flip
    assert ident("data.regenerate.turns=last", "data.regenerate.concurrency=3") == on  # how, not what


@pytest.mark.parametrize("cut, ok, skipped", [("keep", 3, 0), ("skip", 0, 3)])
def test_a_turn_cut_at_max_new_tokens_is_kept_as_cut_or_its_record_skipped(tmp_path, cut, ok, skipped):
    counts = run(small_run_cfg(tmp_path, *LAST, f"data.regenerate.cut={cut}", "data.max_failures=10", limit=3))
    assert counts["ok"] == ok and counts["skipped"].get("regenerate_cut", 0) == skipped


def test_through_the_server_the_answers_are_the_servers_ids_and_no_generation_pass_is_dumped(
    tmp_path, tokenizer, caplog
):
    """backend=sglang (the fake server driving the real seam): each turn is one /generate request whose
    rid the hook does not dump; the capture stores the prompt's ids then the ids the server returned."""
    from test_sglang_backend import sg_cfg

    cfg = sg_cfg(tmp_path, *LAST, "data.limit=4", "client.self_check=0")
    counts = run(cfg)
    assert counts["ok"] == 4 and not counts["failed"]  # a dumped generation would be a rid the run never sent
    assert "server died" not in caplog.text and "retrying" not in caplog.text  # one server, up throughout
    r, turns = ShardReader(tmp_path / "out"), {t["id"]: t for t in rows(tmp_path / "out", "turn")}
    model = load_causal_lm(r.manifest["model"]["path"], torch.bfloat16)
    for sid in r.ids:
        x, t = r.get(sid), turns[sid]
        n = len(x["input_ids"]) - len(t["generated"])
        assert x["input_ids"].tolist()[n:] == t["generated"] and x["loss_mask"].tolist() == [0] * n + [1] * (
            len(t["generated"])
        )
        torch.manual_seed(turn_seed(0, sid, t["message"]))
        again = model.generate(input_ids=x["input_ids"][None, :n].long(), max_new_tokens=16, do_sample=True,
                               temperature=0.7, top_p=0.95, top_k=None, eos_token_id=stop_token(tokenizer),
                               pad_token_id=0)  # fmt: skip
        assert again[0, n:].tolist() == t["generated"]


def test_records_of_prompts_alone_get_the_targets_answer(tmp_path, tokenizer):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Name a {w}."}) + "\n" for w in ("colour", "fruit", "river")))
    counts = run(small_run_cfg(tmp_path, *LAST, f"data.sources=[{src}]"))
    assert counts["ok"] == 3 and not counts["skipped"]
    r, turns = ShardReader(tmp_path / "out"), {t["id"]: t for t in rows(tmp_path / "out", "turn")}
    for sid in r.ids:
        x, t = r.get(sid), turns[sid]
        assert t["message"] == 1  # the answer to the prompt, written after it
        prompt = x["input_ids"].tolist()[: -len(t["generated"])]
        assert tokenizer.decode(prompt).startswith("<|im_start|>user\nName a ") and x["loss_mask"].sum() == len(
            t["generated"]
        )
    with pytest.raises(data.DataError, match="no_assistant_turn"):  # without it, a prompt alone trains nothing
        run(small_run_cfg(tmp_path / "off", f"data.sources=[{src}]"))


def test_a_link_in_place_of_the_file_is_refused_and_its_target_untouched(tmp_path):
    user = tmp_path / "mine.jsonl"
    user.write_bytes(b'{"turn": {"id": "x"')  # a file of the user's, its last line without a newline
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / FILE).symlink_to(user)
    with pytest.raises(UserError, match="is a link"):
        run(small_run_cfg(tmp_path, *LAST, limit=2))
    assert user.read_bytes() == b'{"turn": {"id": "x"'  # neither cut nor appended to


def test_a_server_is_sent_data_regenerate_concurrency_turns_at_once(tmp_path, monkeypatch):
    """A server batches the decode passes of the turns it is sent together: regeneration keeps
    data.regenerate.concurrency of them in flight (not the capture's client.concurrency, 4 here)."""
    import threading
    import time

    from test_sglang_backend import sg_cfg

    from recipe.backends import sglang as sg

    lock, now, peak, real = threading.Lock(), [0], [0], sg.SGLangBackend.generate

    def generate(self, *a, **k):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.3)  # every worker gets a turn out before the first comes back
        try:
            return real(self, *a, **k)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(sg.SGLangBackend, "generate", generate)
    cfg = sg_cfg(tmp_path, *LAST, "data.limit=8", "client.self_check=0", "data.regenerate.concurrency=6")
    assert run(cfg)["ok"] == 8 and peak[0] == 6
