"""bench/draft_peer.py's inputs, on the CPU: the conversations it hands SpecForge (each with bench/draft's
system turn) come back through SpecForge's own preprocessing as our shards' token ids and loss masks, and
its check of SpecForge's files against our shards sees a changed id or mask bit."""

import json
import random
import sys
import warnings

import pytest
import torch
from conftest import ROOT, compose

if not (ROOT / "bench" / "draft_peer.py").exists():  # inside the image (compose's test profile): no benches
    pytest.skip("bench/ is not in the image", allow_module_level=True)
sys.path.insert(0, str(ROOT / "bench"))
import draft  # noqa: E402
import draft_peer  # noqa: E402
import peers  # noqa: E402

from recipe.main import run  # noqa: E402
from recipe.models import make_tokenizer  # noqa: E402
from recipe.shards.export import specforge_file  # noqa: E402

TINY = dict(draft.TARGET, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A bench/draft work folder: a tiny target, its training conversations, our shards of them."""
    work = tmp_path_factory.mktemp("draft-peer")
    tok = make_tokenizer("llama3")
    draft.save_target(draft.target_model(draft.Chat(tok), 0, TINY), tok, work / "target")
    files, rng = draft.corpus(2 << 20)[0], random.Random(0)
    (work / "data").mkdir()
    with open(work / "data" / "train.jsonl", "w") as f:
        for _ in range(6):
            user, reply = draft.window(files, rng)
            msgs = [draft.system_message(), {"role": "user", "content": user.decode()}]
            msgs.append({"role": "assistant", "content": reply.decode()})
            f.write(json.dumps({"messages": msgs}) + "\n")
    data = work / "data" / "train.jsonl"
    run(compose([
        f"model.path={work / 'target'}", "model.name=peer", "data=jsonl", f"data.sources=[{data}]",
        "capture.layers=[2,4,5]", f"output_dir={work / 'shards' / 'real'}", f"capture.dump_dir={work / 'shm'}",
    ]))  # fmt: skip
    return work


def specforge_files(work, ids_list, masks):
    """SpecForge's layout of what its preprocessing made of the conversations, with our shards' states
    (line i's), numbered in reverse, as its batches number files in their own order."""
    from recipe.data import sample_id, to_messages
    from recipe.shards import ShardReader
    from recipe.shards.export import specforge_raw

    reader, out = ShardReader(work / "shards" / "real"), work / "sf-peer"
    lines = (work / "data" / "train.jsonl").read_text().splitlines()
    n = len(ids_list)
    for i, (ids, mask) in enumerate(zip(ids_list, masks)):
        states = specforge_raw(reader.get(sample_id(to_messages(json.loads(lines[i])))), 3)
        (out / specforge_file(n - 1 - i)).parent.mkdir(parents=True, exist_ok=True)
        torch.save(states | {"input_ids": ids, "loss_mask": mask}, out / specforge_file(n - 1 - i))


def same_data(work):
    """draft_peer's check: bench/peers.py's, over the conversations."""
    return peers.compare(work / "shards" / "real", work / "sf-peer", work / "data" / "train.jsonl", limit=64)


def test_specforge_reads_the_conversations_as_our_shards_ids_and_masks_and_a_change_is_seen(work):
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY

    from recipe.data import sample_id, to_messages
    from recipe.shards import ShardReader

    data = draft_peer.write_specforge_data(work)
    convs = [json.loads(x)["conversations"] for x in data.read_text().splitlines()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sf = preprocess_conversations(
            make_tokenizer("llama3"), convs, TEMPLATE_REGISTRY.get("llama3"), max_length=2048,
            tools=[[]] * len(convs),  # its default, [[]], would zip to one record
        )  # fmt: skip
    ids_list, masks = [x.view(-1) for x in sf["input_ids"]], [x.view(-1) for x in sf["loss_mask"]]
    reader = ShardReader(work / "shards" / "real")
    ours_ids = [reader.get(sample_id(to_messages({"messages": c})))["input_ids"].tolist() for c in convs]
    assert [x.tolist() for x in ids_list] == ours_ids
    specforge_files(work, ids_list, masks)
    same = same_data(work)
    assert (same["samples"], same["ids_equal"], same["loss_mask_equal"]) == (6, 6, 6)

    masks[1] = masks[1].clone()
    masks[1][-3] = 1 - masks[1][-3]
    ids_list[2] = ids_list[2].clone()
    ids_list[2][-2] += 1  # past the first 256 ids that find the sample
    specforge_files(work, ids_list, masks)
    seen = same_data(work)
    assert (seen["samples"], seen["ids_equal"], seen["loss_mask_equal"]) == (6, 5, 5)


def test_the_verdict_weighs_the_difference_of_the_sets_against_the_spread_of_their_seeds():
    def acc(ours, specforge):
        arms = draft_peer.seed_arms(len(ours))
        return {a: {"accept_length": x} for a, x in zip(arms["ours"] + arms["specforge"], ours + specforge)}

    alike = draft_peer.verdict(acc([3.30, 3.35, 3.32], [3.27, 3.36, 3.31]), 3)
    apart = draft_peer.verdict(acc([3.30, 3.31, 3.32], [3.25, 3.26, 3.27]), 3)
    assert alike["within_noise"] and not apart["within_noise"]
    assert apart["specforge_minus_ours"] == -0.05 and apart["standard_error"] == 0.008
    assert apart["degrees_of_freedom"] == 4 and apart["accept_length"]["specforge"] == [3.25, 3.26, 3.27]


def test_the_control_sizes_read_from_a_real_shard_set(work):
    """bench/draft's measure of each control's error in the data (run on the GPU beside training), on the
    fixture's shards: the slots by their layers, every stored position counted."""
    from recipe.shards import ShardReader

    sizes = draft.control_sizes(work)
    reader = ShardReader(work / "shards" / "real")
    assert sizes["wrong_norm_teacher"]["positions"] == sum(len(reader.get(s)["input_ids"]) for s in reader.ids)
    assert set(sizes["slot_distances"]) == {"2-4", "2-5", "4-5"}
    assert all(0 < d["rel_l2"] and -1 <= d["cosine"] <= 1 for d in sizes["slot_distances"].values())


def test_each_set_trains_its_seeds_from_its_own_files(tmp_path, monkeypatch):
    """SpecForge's files at seeds 0..K-1 (its file count as the schedule's samples), our shards at seeds
    1..K-1 (seed 0 is bench/draft's real draft): a seed or a set crossed over would void the verdict."""
    launched = {}

    def launch(work, arm, inputs, layer_ids, plan, serve):
        launched[arm] = (inputs[arm]["features"], plan, serve)
        return object(), 0.0

    def finish(work, arm, p, t0, draft_cfg, served):
        (work / "drafts" / f"{arm}-curve.json").write_text(json.dumps([{"step": 10, "acc": 0.5}]))
        return arm

    monkeypatch.setattr(draft, "launch_arm", launch)
    monkeypatch.setattr(draft, "finish_arm", finish)
    (tmp_path / "drafts").mkdir()
    plan = {"epochs": 4, "batch_size": 64, "samples": 6000}
    arms = draft_peer.train_peers(tmp_path, plan, [1, 3, 4], 5984, seeds=3)
    assert set(arms) == set(launched) == {"specforge_set", "specforge_set_seed1", "specforge_set_seed2",
                                          "real_seed1", "real_seed2"}  # fmt: skip
    for s, arm in enumerate(["specforge_set", "specforge_set_seed1", "specforge_set_seed2"]):
        assert launched[arm] == (tmp_path / "sf-peer", dict(plan, samples=5984, seed=s), True)
    for s in (1, 2):
        assert launched[f"real_seed{s}"] == (tmp_path / "shards" / "real", dict(plan, seed=s), True)
