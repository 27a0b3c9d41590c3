"""Draft vocabularies from the shards, held against the trainers' own functions on the same samples (the
set's samples in index order): SpecForge 0.2.0's generate_vocab_mapping_file and its trainer's
offline mapping, speculators 0.9.0's save_token_frequency_distribution and
build_vocab_mappings_from_distribution."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, compose

from recipe.main import run
from recipe.shards import ShardReader, tokencounts
from recipe.shards.vocabmap import specforge_ids, speculators_ids, write

V = 272  # tiny-llama's vocabulary


def trainer(name):
    import os

    return __import__(name) if os.environ.get("CI") else pytest.importorskip(name)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocab")
    run(compose([f"output_dir={tmp / 'out'}", f"capture.dump_dir={tmp / 'shm'}", "log_every_s=1000"]))
    return tmp / "out"


def items(root) -> list[dict]:
    """The set's samples in index order, as the trainers' datasets hold them (torch tensors)."""
    r = ShardReader(root)
    return [{"input_ids": (x := r.get(i))["input_ids"].long(), "loss_mask": x["loss_mask"].long()} for i in r.ids]


class Columns:
    """What SpecForge's generate_vocab_mapping_file reads of an HF dataset: its columns and its length."""

    def __init__(self, rows):
        self.rows = rows

    def __getitem__(self, name):
        return [row[name] for row in self.rows]

    def __len__(self):
        return len(self.rows)


def tie_sensitive_sizes(root) -> list[int]:
    """Draft sizes at which the two trainers' tie rules keep different ids: where the order of ties
    decides, so that matching a trainer proves its rule, not only the counts."""
    counts = tokencounts.load(root, ShardReader(root).records)
    return [n for n in range(2, counts.ranked) if specforge_ids(counts, n)[0] != speculators_ids(counts, n)[0]]


def test_specforge_mapping_is_what_specforges_own_function_builds(shards, tmp_path):
    trainer("specforge")
    from specforge.data.preprocessing import generate_vocab_mapping_file

    sizes = tie_sensitive_sizes(shards)
    counts = tokencounts.load(shards, ShardReader(shards).records)
    assert sizes, "no draft size where ties decide: the data cannot tell the tie rules apart"
    for draft in (sizes[0], sizes[len(sizes) // 2], counts.ranked + 30):  # the last one pads
        write(shards, tmp_path / f"ours-{draft}", draft, ("specforge",))
        path = generate_vocab_mapping_file(Columns(items(shards)), V, draft, str(tmp_path / "sf"), f"k{draft}")
        ours, theirs = torch.load(tmp_path / f"ours-{draft}" / "vocab_mapping.pt"), torch.load(path)
        for k in ("d2t", "t2d"):
            assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), (draft, k)


def test_speculators_mapping_and_frequencies_are_what_its_own_functions_build(shards, tmp_path):
    trainer("speculators")
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        save_token_frequency_distribution,
    )

    save_token_frequency_distribution(items(shards), tmp_path / "theirs.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    counts = tokencounts.load(shards, ShardReader(shards).records)
    for draft in (tie_sensitive_sizes(shards)[0], counts.ranked + 30):
        write(shards, tmp_path / f"ours-{draft}", draft, ("speculators",))
        ours = torch.load(tmp_path / f"ours-{draft}" / "token_freq.pt", weights_only=True)
        assert list(ours.items()) == list(theirs.items())
        d2t, t2d = build_vocab_mappings_from_distribution(theirs, draft, V)
        assert np.array_equal(np.load(tmp_path / f"ours-{draft}" / "d2t.npy"), d2t.numpy())
        assert np.array_equal(np.load(tmp_path / f"ours-{draft}" / "t2d.npy"), t2d.numpy())


def test_specforges_trainer_reading_the_shards_installs_the_same_mapping(shards, tmp_path):
    """Its offline mapping step, run under specforge_reads_shards on the shard set (which has no feature
    files for SpecForge to count): the d2t/t2d it installs in the draft are vocab-map's."""
    trainer("specforge")
    from types import SimpleNamespace

    from specforge.algorithms.contracts import FeatureMode
    from specforge.training import assembly

    from recipe.shards.trainers import specforge_reads_shards

    draft = tie_sensitive_sizes(shards)[0]
    write(shards, tmp_path / "ours", draft, ("specforge",))
    model = SimpleNamespace(d2t=torch.zeros(draft, dtype=torch.long), t2d=torch.zeros(V, dtype=torch.bool))
    bundle = SimpleNamespace(draft_vocab_size=draft, target_vocab_size=V, draft_model=model)
    cfg = SimpleNamespace(model=SimpleNamespace(vocab_mapping_path=""),
                          data=SimpleNamespace(hidden_states_path=str(shards), max_length=4096,
                                               cache_dir=str(tmp_path / "cache")))  # fmt: skip
    algorithm = SimpleNamespace(providers=SimpleNamespace(vocab_mapping_modes=[FeatureMode.OFFLINE]))
    with specforge_reads_shards():
        assembly._ensure_offline_vocab_mapping(cfg, bundle, algorithm)
    ours = torch.load(tmp_path / "ours" / "vocab_mapping.pt")
    assert torch.equal(model.d2t, ours["d2t"]) and torch.equal(model.t2d, ours["t2d"])
    assert model.vocab_mapping_loaded


def cli(*args):
    return subprocess.run([sys.executable, "-m", "recipe.shards", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip


def test_vocab_map_and_export_write_one_mapping_and_refuse_sizes_in_one_line(shards, tmp_path):
    r = cli("vocab-map", shards, "--draft-vocab", 32, "--out", tmp_path / "vm")
    assert r.returncode == 0, r.stderr
    assert "model.vocab_mapping_path" in r.stdout and "--d2t-path" in r.stdout
    assert cli("export", "--to", "specforge", "--draft-vocab", 32, shards, tmp_path / "sf").returncode == 0
    a, b = (
        torch.load(tmp_path / "vm" / "vocab_mapping.pt"),
        torch.load(tmp_path / "sf" / "vocab_mapping" / "vocab_mapping.pt"),
    )
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    assert cli("export", "--to", "speculators", "--draft-vocab", 32, shards, tmp_path / "sp").returncode == 0
    assert np.array_equal(np.load(tmp_path / "vm" / "d2t.npy"), np.load(tmp_path / "sp" / "d2t.npy"))
    assert (tmp_path / "sp" / "token_freq.pt").exists()  # where speculators' trainer looks by default
    for bad, says in ((0, "need 1 <= draft vocabulary"), (V + 1, f"the target's \\({V}\\)")):
        r = cli("vocab-map", shards, "--draft-vocab", bad, "--out", tmp_path / f"bad{bad}")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert __import__("re").search(says, r.stderr), r.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "d2t.npy").write_text("the user's")
    r = cli("vocab-map", shards, "--draft-vocab", 32, "--out", tmp_path / "mine")
    assert r.returncode == 2 and "files vocab-map did not write" in r.stderr
    assert (tmp_path / "mine" / "d2t.npy").read_text() == "the user's"


@pytest.mark.parametrize("form", ["specforge", "speculators"])
def test_export_takes_the_target_vocabulary_from_the_argument_not_the_checkpoint(shards, tmp_path, form):
    r = cli("export", "--to", form, "--draft-vocab", 32, "--target-vocab", V + 28, shards, tmp_path / "x")
    assert r.returncode == 0, r.stderr
    if form == "specforge":
        m = torch.load(tmp_path / "x" / "vocab_mapping" / "vocab_mapping.pt")
        d2t, t2d = m["d2t"].numpy(), m["t2d"].numpy()
    else:
        d2t, t2d = np.load(tmp_path / "x" / "d2t.npy"), np.load(tmp_path / "x" / "t2d.npy")
    assert t2d.shape == (V + 28,) and d2t.shape == (32,) and t2d.sum() == 32
    r = cli("vocab-map", shards, "--draft-vocab", 32, "--target-vocab", V + 28, "--out", tmp_path / "vm")
    assert r.returncode == 0 and np.load(tmp_path / "vm" / "t2d.npy").shape == (V + 28,)


def test_every_size_at_its_edges_is_kept_or_refused_in_one_line(shards, tmp_path):
    top = int(np.flatnonzero(tokencounts.load(shards, ShardReader(shards).records).all)[-1])  # the set's top id
    for draft, target, ok in ((0, V, False), (1, V, True), (V - 1, V, True), (V, V, True), (V + 1, V, False),
                              (1, top, False), (1, top + 1, True), (1, 0, False)):  # fmt: skip
        out = tmp_path / f"d{draft}-t{target}"
        r = cli("vocab-map", shards, "--draft-vocab", draft, "--target-vocab", target, "--out", out)
        assert (r.returncode == 0) == ok and "Traceback" not in r.stderr, (draft, target, r.stderr)
        if not ok:
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and not out.exists(), (draft, target)
            continue
        d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
        kept = d2t + np.arange(draft)
        assert d2t.shape == (draft,) and t2d.shape == (target,) and t2d.sum() == draft
        assert np.array_equal(np.flatnonzero(t2d), kept)  # d2t and t2d name the same ids
        sf = torch.load(out / "vocab_mapping.pt")
        assert sf["t2d"].numel() == target and sf["d2t"].numel() == draft
        if draft == target:  # a draft as wide as its target keeps every id
            assert t2d.all() and not d2t.any() and not sf["d2t"].any()
