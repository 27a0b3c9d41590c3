"""bench/draft's own plumbing, on the CPU: what its training processes are handed arrives whole."""

import sys

import pytest
from conftest import ROOT

if not (ROOT / "bench" / "draft").is_dir():  # inside the image (compose's test profile): no benches
    pytest.skip("bench/ is not in the image", allow_module_level=True)
sys.path.insert(0, str(ROOT / "bench"))
import draft  # noqa: E402


@pytest.mark.parametrize("export", [True, False])
def test_a_training_process_gets_its_config_and_the_sglang_export_options_whole(tmp_path, monkeypatch, export):
    """The export's options (`--to sglang --checkpoint ...`) are not this script's: argparse must never
    see them, or every served arm's training exits 2 before it starts."""
    got = []
    monkeypatch.setattr(draft.scenario, "sf_train", lambda *a: got.append(a) or 0)
    cfg, draft_json = tmp_path / "real.yaml", tmp_path / "draft.json"
    argv = draft.sftrain_argv(tmp_path, "real", cfg, draft_json, export)
    assert draft.main(argv) == 0
    expected = ("real", str(cfg), *(draft.sglang_export_args(tmp_path, "real", draft_json) if export else ()))
    assert got == [expected]
    assert ("--to" in expected) == export


def test_slot_distances_measure_each_pair_against_the_deeper_slot():
    import torch

    x, y = torch.randn(5, 8), torch.randn(5, 8)
    y = y - (y * x).sum(-1, keepdim=True) / x.square().sum(-1, keepdim=True) * x  # orthogonal to x per position
    h = torch.stack([x, 2 * x, y, torch.randn(5, 8)], 1)  # slots at layers 2, 4, 5, then the final state
    d = draft.slot_distances([h, h], [2, 4, 5])
    assert d["2-4"] == {"rel_l2": 0.5, "cosine": 1.0}
    assert abs(d["2-5"]["cosine"]) < 1e-4 and abs(d["4-5"]["cosine"]) < 1e-4
    expected = float(((2 * x - y).square().sum() / y.square().sum()).sqrt())
    assert abs(d["4-5"]["rel_l2"] - expected) < 1e-3


@pytest.mark.parametrize("depth, real", [(8, [2, 4, 5]), (16, [2, 8, 13])])
def test_the_extractions_capture_the_default_layers_of_the_target_on_disk(tmp_path, depth, real):
    """The draft config claims the saved target's default layers; the off-by-one control is each one
    deeper. `--target-layers` sets that depth, and a resumed call reads it from the saved target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(f'{{"num_hidden_layers": {depth}}}')
    assert draft.capture_runs(tmp_path) == {"real": (real, ()), "off_by_one": ([i + 1 for i in real], ())}
    assert draft.capture_runs(tmp_path, fp8=True)["fp8"] == (real, ("shards.codec=fp8",))
    # a call that trains no off_by_one arm spends no GPU time on its set
    assert draft.capture_runs(tmp_path, arms=draft.arms({"only": ["full_vocab"], "draft_vocab": 8})) == {
        "real": (real, ())
    }
    assert draft.parse_args(["target"]).target_layers == draft.TARGET["num_hidden_layers"] == 16


@pytest.fixture(scope="module")
def bpe_work(tmp_path_factory):
    """A bench/draft work folder with a BPE target (--bpe-vocab), its shards, and a (copied) fp8 set."""
    import json
    import random
    import shutil

    from conftest import compose

    from recipe.main import run

    work = tmp_path_factory.mktemp("draft-bpe")
    files = draft.corpus(2 << 20)[0]
    tok = draft.tokenizer.bpe_tokenizer(files, 600)
    tiny = dict(draft.TARGET, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    draft.save_target(draft.target_model(draft.Chat(tok), 0, tiny), tok, work / "target")
    rng = random.Random(0)
    (work / "data").mkdir()
    with open(work / "data" / "train.jsonl", "w") as f:
        for _ in range(8):
            user, reply = draft.window(files, rng)
            msgs = [draft.system_message(), {"role": "user", "content": user.decode()}]
            f.write(json.dumps({"messages": [*msgs, {"role": "assistant", "content": reply.decode()}]}) + "\n")
    run(compose([
        f"model.path={work / 'target'}", "model.name=bpe", "data=jsonl",
        f"data.sources=[{work / 'data' / 'train.jsonl'}]", "capture.layers=[2,8,13]",
        f"output_dir={work / 'shards' / 'real'}", f"capture.dump_dir={work / 'shm'}",
    ]))  # fmt: skip
    for other in ("fp8", "original"):  # their paths are what the arms are handed
        shutil.copytree(work / "shards" / "real", work / "shards" / other)
    return work, tok, files


def test_the_bpe_targets_conversations_are_the_ids_the_recipe_extracts(bpe_work):
    """The target trains on the template's text encoded whole: what `python -m recipe` stores for the same
    conversation, so the draft learns the states of the ids the target saw."""
    import random

    from recipe.data import tokenize

    _, tok, files = bpe_work
    chat, rng = draft.Chat(tok), random.Random(3)
    pairs = [draft.window(files, rng) for _ in range(4)]
    for (u, r), ids in zip(pairs, chat.conversations(pairs)):
        msgs = [
            draft.system_message(),
            {"role": "user", "content": u.decode()},
            {"role": "assistant", "content": r.decode()},
        ]
        assert tokenize(tok, msgs)[0].tolist() == ids
    assert chat.vocab % 16 == 0 and chat.vocab >= len(tok) == 600


def test_each_arm_gets_its_shards_draft_config_and_vocabulary_mapping(bpe_work):
    """--draft-vocab: the set's own mapping (the recipe's vocab-map) for the real draft, its controls and
    seeds; none for full_vocab (the whole vocabulary); the prose's for other_data, the set's counts on
    shuffled ids for shuffled; fp8 arms on the fp8 set, fp8_final and fp8_aux on the lossless one (they
    quantize their slots as they read it). A mapping or a set crossed over would void the comparison."""
    import json

    import torch

    work, tok, _ = bpe_work
    plan = {"draft_vocab": 128, "seeds": 2, "fp8": True, "fp8_slots": True, "epochs": 1, "batch_size": 4,
            "learning_rate": 1e-3, "ttt_length": 3, "export_steps": 60, "samples": 8}  # fmt: skip
    got = draft.arm_inputs(work, plan, [1, 7, 12])
    arms = got["arms"]
    slot_arms = {"fp8_final", "fp8_final_seed1", "fp8_aux", "fp8_aux_seed1"}
    assert set(arms) == {*draft.ARMS, "full_vocab", "other_data", "shuffled", "real_seed1", "fp8", "fp8_seed1",
                         *slot_arms}  # fmt: skip
    real_map, other_map, moved_map = (
        str(work / "vocab" / "real" / "vocab_mapping.pt"),
        str(work / "vocab" / "other" / "vocab_mapping.pt"),
        str(work / "vocab" / "shuffled" / "vocab_mapping.pt"),
    )
    for arm in (
        "real",
        "permuted",
        "wrong_norm",
        "off_by_one",
        "untrained",
        "real_seed1",
        "fp8",
        "fp8_seed1",
        "real_export",
        *slot_arms,
    ):
        assert arms[arm]["vocab_map"] == real_map, arm
    assert arms["other_data"]["vocab_map"] == other_map and arms["full_vocab"]["vocab_map"] is None
    assert arms["shuffled"]["vocab_map"] == moved_map
    assert arms["fp8_seed1"]["features"] == arms["fp8"]["features"] == work / "shards" / "fp8"
    assert arms["real_seed1"]["features"] == work / "shards" / "real"
    assert {arms[arm]["features"] for arm in slot_arms} == {work / "shards" / "real"}
    sizes = {arm: json.loads(x["draft"].read_text())["draft_vocab_size"] for arm, x in arms.items()}
    assert sizes.pop("full_vocab") == draft.Chat(tok).vocab and set(sizes.values()) == {128}
    ours, theirs, moved = torch.load(real_map), torch.load(other_map), torch.load(moved_map)
    assert ours["d2t"].numel() == theirs["d2t"].numel() == moved["d2t"].numel() == 128
    assert not torch.equal(ours["t2d"], theirs["t2d"]) and not torch.equal(ours["t2d"], moved["t2d"])
    cover = {k: got["vocab"][k]["coverage"] for k in ("real", "other_data", "shuffled")}
    assert cover["real"] > cover["other_data"] and cover["real"] > cover["shuffled"], cover
    cfg = json.loads(draft.run_yaml(work, "fp8_seed1", arms["fp8_seed1"]["features"], arms["fp8_seed1"]["draft"],
                                    [1, 7, 12], plan, arms["fp8_seed1"]["vocab_map"]).read_text())  # fmt: skip
    assert cfg["training"]["seed"] == 1 and cfg["model"]["vocab_mapping_path"] == real_map


def test_a_call_that_names_its_arms_trains_those_and_the_real_draft():
    plan = {"draft_vocab": 128, "seeds": 3, "fp8": True, "only": ["fp8", "fp8_seed1", "fp8_seed2", "real_seed2"]}
    assert draft.arms(plan) == ("real", "real_seed2", "fp8", "fp8_seed1", "fp8_seed2")
    assert draft.arms({}) == draft.ARMS


def test_the_targets_own_style_differs_from_the_files_line_for_line():
    """--regen: the target answers with tabs and single quotes; the data holds the files' own answers."""
    reply = b'def f(x):\n    if x:\n        return "a"\n      odd = 1\nprint("b")'
    assert draft.chat.styled(reply) == b"def f(x):\n\tif x:\n\t\treturn 'a'\n\t  odd = 1\nprint('b')"


def test_a_regen_call_trains_drafts_on_the_targets_answers_and_on_the_original_ones(bpe_work, tmp_path):
    """The real set is captured with the recipe's data.regenerate (the target rewrites each answer through
    the same server), the original set from the same records as given; seed s of each trains on its own
    set, and with a reduced vocabulary through its own set's mapping."""
    from conftest import compose

    work, _, _ = bpe_work
    plan = {"regen": True, "seeds": 3, "draft_vocab": 0}
    assert draft.arms(plan) == ("real", "real_seed1", "real_seed2", "original", "original_seed1", "original_seed2")
    runs = draft.capture_runs(work, regen=True)
    assert runs["real"][0] == runs["original"][0] and runs["original"][1] == ()
    assert "data.regenerate.turns=last" in runs["real"][1] and "data.regenerate.temperature=0" in runs["real"][1]
    argv = draft.recipe_argv(work, "real", *runs["real"][0:1], 31100, runs["real"][1])
    cfg = compose([a for a in argv[3:] if not a.startswith("hydra.")])  # the user's command composes as given
    assert cfg.data.regenerate.turns == "last" and cfg.data.regenerate.temperature == 0
    inputs = draft.arm_inputs(work, {**plan, "fp8": False}, [1, 7, 12])["arms"]
    assert {a: x["features"].name for a, x in inputs.items()} == {
        "real": "real", "real_seed1": "real", "real_seed2": "real",
        "original": "original", "original_seed1": "original", "original_seed2": "original",
    }  # fmt: skip
    reduced = draft.arm_inputs(work, {**plan, "fp8": False, "draft_vocab": 128}, [1, 7, 12])["arms"]
    for arm, x in reduced.items():  # with --draft-vocab each draft gets its own set's mapping
        assert x["vocab_map"] == str(work / "vocab" / x["features"].name / "vocab_mapping.pt"), arm


def test_the_target_step_leaves_the_gpu_to_the_trainers_that_follow(tmp_path, monkeypatch):
    """The bench's own process trains the target, then spawns trainers and servers on the same GPU: it
    frees its cache once the model is gone (a 16K-id target's kept 58 GB, and the trainers ran out)."""
    import weakref

    import torch

    models, freed = [], []
    build = draft.target.target_model
    monkeypatch.setattr(draft.target, "target_model", lambda *a: models.append(weakref.ref(m := build(*a))) or m)
    monkeypatch.setattr(draft.target, "corpus", lambda: draft.corpus(1 << 20))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append([r() is None for r in models]))
    tiny = dict(draft.TARGET, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(draft.target, "TARGET", tiny)
    draft.target.train_target(tmp_path, 0.5, 3.0, layers=2)
    assert (tmp_path / "target" / "target.json").exists()
    assert freed == [[True]], "the cache was not freed, or freed while the target's weights were still held"


def test_a_call_that_trains_an_arm_without_its_set_stops_in_one_line(bpe_work):
    """A first call that trained no off_by_one arm captured no set for it; a resumed call naming that arm
    says what to run, instead of handing SpecForge a missing folder."""
    work, _, _ = bpe_work
    inputs = draft.arm_inputs(work, {"seeds": 1}, [1, 7, 12])["arms"]
    with pytest.raises(SystemExit, match=r"no shards at .*off_by_one: run `bench/draft extract`"):
        draft.train.need_sets(inputs, ["real", "off_by_one"])
    draft.train.need_sets(inputs, ["real", "permuted", "wrong_norm"])  # theirs is the real set, there


def test_a_resumed_call_naming_new_arms_captures_and_trains_what_they_need(bpe_work):
    """A recorded extract or train step is run again when this call's arms need a set it did not capture
    or a draft it did not train; what is there already is kept."""
    work, _, _ = bpe_work
    plan = {"fp8": False, "regen": False, "draft_vocab": 8}
    assert draft.scenario.unfinished(work, "extract", {**plan, "only": ["off_by_one"]})  # no shards/off_by_one
    assert not draft.scenario.unfinished(work, "extract", {**plan, "only": ["full_vocab"]})  # shards/real is there
    assert draft.scenario.unfinished(work, "train", {**plan, "only": ["full_vocab"]})  # no draft trained yet
    assert not draft.scenario.unfinished(work, "serve", plan)


def test_the_controls_held_out_prompts_are_read_in_the_main_thread(tmp_path, monkeypatch):
    """Each control's acceptance is measured in a thread of its own as its server comes up; the prompts
    are read (tokenizer and all) before it starts, as two threads importing transformers at once fail."""
    import threading

    class Up:
        start = wait_ready = lambda self, *a, **k: None
        stop = lambda self, **k: None  # noqa: E731

    readers, serve = [], sys.modules["draft.serve"]
    monkeypatch.setattr(serve, "eagle3_server", lambda *a: Up())
    monkeypatch.setattr(serve, "eval_prompts", lambda w: readers.append(threading.current_thread()) or [[1]])
    monkeypatch.setattr(serve, "decode_figures", lambda *a: readers.append(threading.current_thread()) or {})
    monkeypatch.setattr(serve, "stop_ids", lambda w: [0])
    serving = serve.Serving(tmp_path, {"draft_vocab": 64, "only": ["other_data", "shuffled"]})
    for arm in ("other_data", "shuffled"):
        serving.start(arm)
    for t in serving.threads:
        t.join()
    main = threading.main_thread()
    assert readers.count(main) == 2 and len(readers) == 6 and set(serving.acceptance) == {"other_data", "shuffled"}


def test_an_arm_out_of_gpu_memory_beside_the_others_trains_again_once_one_ends(tmp_path):
    """Four trainers of a 16K-id target filled an 80 GB H100 and one died: it is started again when another
    arm ends, never counted as trained, and the call goes on. A trainer that fails otherwise still stops it."""
    import subprocess

    train = sys.modules["draft.train"]
    (tmp_path / "drafts").mkdir()
    logs = {"a": "step 1 loss 2.0\n", "b": "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n"}
    events, launched = [], []

    def launch(arm):
        launched.append(arm)
        (tmp_path / "drafts" / f"{arm}.log").write_text("step 1 loss 2.0\n")  # the second try fits
        return subprocess.Popen([sys.executable, "-c", "pass"]), 0.0

    def finish(arm, p, t0):
        events.append(("end", arm))
        if arm not in launched:  # the first try of each: exits as its log says
            (tmp_path / "drafts" / f"{arm}.log").write_text(logs[arm])
            p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({int(arm == 'b')})"])
        return train.finish_arm(tmp_path, arm, p, t0, tmp_path / "draft.json", ())

    first = {arm: (subprocess.Popen([sys.executable, "-c", "pass"]), 0.0) for arm in logs}
    sys.modules["draft.waves"].run_arms(first, finish, launch, lambda arm: events.append(("ready", arm)))
    assert launched == ["b"] and sorted(e for e in events if e[0] == "ready") == [("ready", "a"), ("ready", "b")]
    assert (tmp_path / "drafts" / "b-curve.json").exists() and (tmp_path / "drafts" / "a-curve.json").exists()

    logs["c"] = "Traceback: ValueError: a bad config\n"
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    (tmp_path / "drafts" / "c.log").write_text(logs["c"])
    fails = lambda arm, p, t0: train.finish_arm(tmp_path, arm, p, t0, None, ())  # noqa: E731
    with pytest.raises(SystemExit, match="train c: specforge train exited 1"):
        sys.modules["draft.waves"].run_arms({"c": (p, 0.0)}, fails, launch, print)


def test_an_fp8_call_trains_a_target_whose_final_state_fp8_can_hold():
    """At the default spread a token's final state spans 1e8 across channels and the self-check refuses an
    fp8 set of it (tests/test_selfcheck.py); an fp8 call's target gets an even one, unless told."""
    assert draft.parse_args(["all", "--fp8"]).norm_spread == 1.0
    assert draft.parse_args(["all"]).norm_spread == 3.0
    assert draft.parse_args(["all", "--fp8", "--norm-spread", "2"]).norm_spread == 2.0


def test_the_bpe_target_regenerates_its_answers_through_its_llama3_template(bpe_work, tmp_path):
    """--regen's real set, as the recipe captures it, on the CPU backend: the BPE target's template trims each
    turn's content, and regeneration still finds its end-of-turn token (the H100 run stopped there once)."""
    from conftest import compose

    from recipe.main import run
    from recipe.shards import ShardReader

    work, tok, _ = bpe_work
    out = tmp_path / "regen"
    counts = run(compose([
        f"model.path={work / 'target'}", "model.name=bpe", "data=jsonl", "data.limit=2",
        f"data.sources=[{work / 'data' / 'train.jsonl'}]", "capture.layers=[2,8,13]", f"output_dir={out}",
        f"capture.dump_dir={tmp_path / 'shm'}", "data.regenerate.turns=last", "data.regenerate.max_new_tokens=8",
    ]))  # fmt: skip
    assert counts["ok"] == 2
    r = ShardReader(out)
    for sid in r.ids:
        x = r.get(sid)
        assert 0 < int(x["loss_mask"].sum()) <= 8 and x["loss_mask"][-1] == 1  # the generated tokens alone


def test_a_call_on_a_work_folder_made_with_other_options_stops_in_one_line(tmp_path, monkeypatch):
    """A work folder holds one target and its drafts: a resumed call with another target (another
    vocabulary, style or norm) or, while drafts are there, other draft options would put arms of two
    scenarios side by side. It stops first, saying what differs and what to do."""
    import json

    scenario = sys.modules["draft.scenario"]

    def server(*a, **k):
        raise AssertionError("a step began")

    monkeypatch.setattr(scenario, "server", server)
    monkeypatch.setattr(scenario, "Serving", server)
    first = scenario.parse_args(["all", "--work", str(tmp_path), "--bpe-vocab", "16384", "--draft-vocab", "4096"])
    (tmp_path / "results.json").write_text(json.dumps({"made_with": scenario.made_with({}, first)}))
    with pytest.raises(SystemExit, match=r"made with --bpe-vocab 16384, not this call's: use another --work"):
        draft.main(["all", "--work", str(tmp_path), "--draft-vocab", "4096"])
    with pytest.raises(SystemExit, match=r"made with --norm-spread 3.0, not this call's"):  # --fp8's own target
        draft.main(["all", "--work", str(tmp_path), "--bpe-vocab", "16384", "--draft-vocab", "4096", "--fp8"])
    smaller = scenario.parse_args(["all", "--work", str(tmp_path), "--bpe-vocab", "16384", "--draft-vocab", "2048"])
    res = json.loads((tmp_path / "results.json").read_text())
    assert scenario.made_with(res, smaller)["draft_vocab"] == 2048  # no drafts yet: the drafts' options are free
    (tmp_path / "drafts").mkdir()
    with pytest.raises(SystemExit, match=r"made with --draft-vocab 4096, not this call's: rm -rf its drafts/"):
        scenario.made_with(res, smaller)


def test_the_fp8_slot_arms_read_the_fp8_sets_values_in_their_slots_and_the_lossless_ones_elsewhere(tmp_path):
    """fp8_final and fp8_aux say which slot an fp8 draft's loss comes from only if each reads, in its
    slots, exactly what an fp8 run stores, and elsewhere exactly the lossless values."""
    import torch
    from conftest import compose

    from recipe.main import run
    from recipe.shards.export import specforge_raw
    from recipe.shards.reader import ShardReader

    for codec in ("lossless", "fp8"):
        run(compose([f"output_dir={tmp_path / codec}", f"capture.dump_dir={tmp_path / 'shm'}", "data.limit=3",
                     f"shards.codec={codec}", "log_every_s=1000"]))  # fmt: skip
    exact, packed = ShardReader(tmp_path / "lossless"), ShardReader(tmp_path / "fp8")
    n_aux = len(exact.manifest["capture"]["layers"])
    for sid in exact.ids:
        want = {k: specforge_raw(r.get(sid), n_aux) for k, r in (("lossless", exact), ("fp8", packed))}
        final, aux = draft.fp8_final(exact.get(sid), n_aux), draft.fp8_aux(exact.get(sid), n_aux)
        assert not torch.equal(want["fp8"]["hidden_state"], want["lossless"]["hidden_state"])
        assert torch.equal(final["hidden_state"], want["fp8"]["hidden_state"])
        assert torch.equal(final["aux_hidden_state"], want["lossless"]["aux_hidden_state"])
        assert torch.equal(aux["aux_hidden_state"], want["fp8"]["aux_hidden_state"])
        assert torch.equal(aux["hidden_state"], want["lossless"]["hidden_state"])
    # the codec's error per slot, measured on the lossless set, is the error the fp8 run recorded
    head = torch.randn(64, exact.get(exact.ids[0])["hidden"].shape[-1])
    sizes = draft.fp8_sizes(head, (exact.get(sid)["hidden"].clone() for sid in exact.ids))
    recorded = packed.manifest["codec"]["rel_l2_error"]
    assert sizes["rel_l2_per_slot"] == pytest.approx([recorded[s] for s in exact.slots], abs=2e-5)
    assert 0.5 < sizes["teacher_argmax_equal_fraction"] <= 1.0


def test_a_later_call_on_other_arms_keeps_what_the_earlier_call_trained_and_served(tmp_path, monkeypatch):
    """fp8 against lossless in one call, then the fp8_final and fp8_aux arms in another on the same
    work folder: the report compares them all, as if one call had run them; an arm whose draft is no
    longer there (drafts/ removed for other draft options) is not kept."""
    import contextlib
    import json

    scenario = sys.modules["draft.scenario"]
    args = ["all", "--work", str(tmp_path), "--bpe-vocab", "16384", "--draft-vocab", "4096", "--seeds", "2", "--fp8"]

    def acc(*arms):
        return {a: {"accept_length": 2.5 + i / 100} for i, a in enumerate(arms)}

    earlier = {"made_with": scenario.made_with({}, scenario.parse_args(args)), "target": {}, "data": {},
               "extract": {}, "train": {"arms": {"fp8": {}, "fp8_seed1": {}}},
               "serve": {"acceptance": acc("real", "real_seed1", "fp8", "fp8_seed1")}}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    (tmp_path / "drafts").mkdir()
    for arm in ("real", "real_seed1", "fp8"):  # fp8_seed1's draft is gone (its result with it)
        (tmp_path / "drafts" / f"{arm}-curve.json").write_text("[]")
    monkeypatch.setattr(scenario, "Serving", lambda work, plan: contextlib.nullcontext())
    monkeypatch.setattr(scenario, "unfinished", lambda work, name, plan: name == "train")
    monkeypatch.setattr(scenario, "train_drafts", lambda work, plan, serving: {"arms": {"fp8_final": {}}})
    monkeypatch.setattr(
        scenario, "serve", lambda work, serving: {"acceptance": acc("real", "fp8_final", "fp8_final_seed1")}
    )
    assert (
        draft.main([*args, "--fp8-slots", "--arms", "fp8_final,fp8_final_seed1", "--out", str(tmp_path / "o.json")])
        == 0
    )
    res = json.loads((tmp_path / "o.json").read_text())
    assert set(res["serve"]["acceptance"]) == {"real", "real_seed1", "fp8", "fp8_final", "fp8_final_seed1"}
    assert set(res["train"]["arms"]) == {"fp8", "fp8_final"}
    seeds = res["goals"]["seeds"]
    assert {"real", "fp8_final", "fp8_final_minus_lossless"} <= set(seeds) and "fp8" not in seeds  # one fp8 seed
    assert seeds["real"]["seeds"] == [2.5, 2.51]  # this call's real, the earlier call's real_seed1
