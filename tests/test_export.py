"""Exports and direct datasets, proven with the trainers' own released code (SpecForge 0.2.0,
speculators 0.9.0, installed by .ci/run): their dataset, their collator, their model's loss.

Nothing here re-implements a trainer: each assertion compares what *their* code yields with what
ShardReader holds, exactly, or runs *their* forward and loss.
"""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import compose

from recipe.main import run
from recipe.shards import ShardReader
from recipe.shards.export import ExportError, export, final_norm_weight

N_AUX, H = 3, 64  # the embedded default: layers [1, 2, 3] + final, tiny-llama hidden 64


def trainer(name):
    """The trainers are test dependencies that .ci/run installs: skipping there would hide a failure."""
    return __import__(name) if os.environ.get("CI") else pytest.importorskip(name)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exp")
    run(compose([f"output_dir={tmp / 'out'}", f"capture.dump_dir={tmp / 'shm'}", "data.limit=12", "log_every_s=1000"]))
    return tmp / "out"


def two_training_steps(model, loss_fn) -> list[float]:
    """Two AdamW steps on the trainable parameters; each loss must be finite."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(2):
        loss = loss_fn()
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mapping(out):
    return {row["file"]: row for row in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


# --- SpecForge ------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["ckpt", "ckpt.gz"])
def test_specforge_dataset_and_collator_read_the_export_exactly(shards, tmp_path, compress):
    trainer("specforge")
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    from recipe.shards.trainers import SpecForgeDataset

    out = tmp_path / "sf"
    info = export("specforge", shards, out, compress=compress)
    assert info["draft_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # ours [1, 2, 3] entering
    assert info["draft_config"]["hidden_size"] == H
    r, rows, direct = ShardReader(shards), mapping(out), SpecForgeDataset(shards, max_len=4096)
    ds = build_offline_eagle3_dataset(str(out), max_len=4096)  # their file listing + loader
    assert len(ds) == len(r) == len(rows) == 12
    assert len(OfflineManifestReader(str(out), validate_files=True).read()) == 12  # their eager key/shape check
    items = []
    for j, path in enumerate(ds.datapaths):
        row = rows[os.path.relpath(path, out)]
        x, item = r.get(row["id"]), ds[j]
        L, ids, mask = row["tokens"], x["input_ids"].long(), x["loss_mask"].long()
        assert item["input_ids"].shape == (1, L) and torch.equal(item["input_ids"][0], ids)
        assert item["loss_mask"].shape == (1, L) and item["loss_mask"].sum() == mask[:-1].sum() > 0
        assert torch.equal(item["loss_mask"][0, :-1], mask[:-1])
        assert torch.equal(item["target"][0], x["hidden"][:, N_AUX])
        assert torch.equal(item["hidden_state"][0], x["hidden"][:, :N_AUX].reshape(L, N_AUX * H))
        d = direct[row["index"]]
        assert d.keys() == item.keys() and all(torch.equal(d[k], item[k]) for k in d)
        items.append((item, x))
    batch = DataCollatorWithPadding()([it for it, _ in items[:5]])
    Lmax = max(x["input_ids"].shape[0] for _, x in items[:5])
    assert batch["input_ids"].shape == (5, Lmax) and batch["hidden_state"].shape == (5, Lmax, N_AUX * H)
    assert batch["target"].shape == (5, Lmax, H)
    assert batch["loss_mask"].sum() == sum(x["loss_mask"][:-1].long().sum() for _, x in items[:5])
    for b, (_, x) in enumerate(items[:5]):
        L = x["input_ids"].shape[0]
        assert torch.equal(batch["target"][b, :L], x["hidden"][:, N_AUX])
        assert torch.equal(batch["input_ids"][b, :L], x["input_ids"].long())
        assert not batch["attention_mask"][b, L:].any() and batch["attention_mask"][b, :L].all()


@pytest.mark.parametrize("max_len", [64, 129])
def test_specforge_reading_the_shards_truncates_as_it_does_its_own_files(shards, tmp_path, max_len):
    """data.max_length under the longest sample: SpecForge over the shards counts the same loss tokens,
    item for item, as SpecForge over its own files of the same samples."""
    trainer("specforge")
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    from recipe.shards.trainers import SpecForgeDataset

    export("specforge", shards, tmp_path / "sf")
    theirs, ours, rows = (
        build_offline_eagle3_dataset(str(tmp_path / "sf"), max_len=max_len),
        None,
        mapping(tmp_path / "sf"),
    )
    ours = SpecForgeDataset(shards, max_len=max_len)
    assert max(r["tokens"] for r in ShardReader(shards).records) > max_len  # it does cut
    total = 0
    for j, path in enumerate(theirs.datapaths):
        a, b = theirs[j], ours[rows[os.path.relpath(path, tmp_path / "sf")]["index"]]
        assert a["input_ids"].shape[1] <= max_len and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        total += int(a["loss_mask"].sum())
    assert total == sum(int(ours[i]["loss_mask"].sum()) for i in range(len(ours))) > 0


def test_specforge_trainer_reads_the_shards_as_it_reads_an_export(shards, tmp_path):
    """Under specforge_reads_shards, SpecForge's own offline reader and feature store serve a shard
    set directly: the same samples, in the same order (its sorted file list: data_0, data_1,
    data_10, ...), with the same tensors as over an export; outside the block, its functions again."""
    trainer("specforge")
    from specforge.runtime.data_plane import feature_store, offline_reader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    from recipe.shards.trainers import specforge_reads_shards

    export("specforge", shards, tmp_path / "sf")

    def served(path):
        refs = offline_reader.OfflineManifestReader(str(path)).read()
        return [LocalFeatureStore().get(ref)[0] for ref in refs]

    theirs = served(tmp_path / "sf")
    saved = (offline_reader.list_feature_files, feature_store.load_feature_file)
    with specforge_reads_shards():
        ours = served(shards)
        assert served(tmp_path / "sf")[0]["input_ids"].equal(theirs[0]["input_ids"])  # other paths: theirs
    assert (offline_reader.list_feature_files, feature_store.load_feature_file) == saved
    assert len(ours) == len(theirs) == 12
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    r = ShardReader(shards)  # third in SpecForge's order is the export's data_10, the 11th sample
    assert torch.equal(ours[2]["input_ids"], r.get(r.ids[10])["input_ids"].long())


def specforge_without_triton():
    """SpecForge's loss module imports Triton at the top (a GPU kernel). Put the torch reference its
    own docstring gives (_compute_loss) in its place; every other piece below is SpecForge's."""
    import types

    import transformers  # noqa: F401  (before the swap, so nothing else sees it)

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return -torch.sum(position_mask * target_p * torch.log_softmax(logits.float(), dim=2), 2).mean()

    mod = types.ModuleType("specforge.core.loss")
    mod.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules.setdefault("specforge.core.loss", mod)


def test_specforge_trains_two_steps_from_shards(shards, tiny_model_dir):
    """SpecForge's draft, TTT model, target head and target preparation, fed by the direct dataset
    through their collator; run eagerly on the CPU (their torch.compile'd helpers, same math)."""
    trainer("specforge")
    specforge_without_triton()
    from safetensors import safe_open
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.strategies.base import _prepare_eagle_target
    from transformers import AutoConfig

    from recipe.shards.trainers import SpecForgeDataset

    batch = DataCollatorWithPadding()([SpecForgeDataset(shards)[i] for i in range(4)])
    head = TargetHead(str(tiny_model_dir))  # their loader wants an index.json; the tiny model has one file
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f, torch.no_grad():
        head.fc.weight.copy_(f.get_tensor("lm_head.weight"))
    head.freeze_weights()
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers, cfg.draft_vocab_size = 1, cfg.vocab_size
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=3, attention_backend="sdpa")
    with torch.compiler.set_stance("force_eager"):
        ids, target, loss_mask = _prepare_eagle_target(
            target_head=head,
            target_repr="hidden_state",
            input_ids=batch["input_ids"],
            target=batch["target"].float(),
            loss_mask=batch["loss_mask"],
            device=torch.device("cpu"),
        )
        assert loss_mask.sum() > 0

        def loss():
            plosses = model(
                input_ids=ids,
                attention_mask=batch["attention_mask"],
                target=target,
                loss_mask=loss_mask,
                hidden_states=batch["hidden_state"].float(),
            )[0]
            return sum(0.8**i * p for i, p in enumerate(plosses))  # their Eagle3TrainStrategy's decay

        losses = two_training_steps(model, loss)
    assert losses[1] < losses[0]


# --- speculators ----------------------------------------------------------------------------


def speculators_model(model_dir, layers=(1, 2, 3)):
    """Their Eagle3 draft, built the way their train CLI does, verifier weights loaded from the target."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    return Eagle3DraftModel.from_training_args(
        cfg,
        t2d=None,
        d2t=None,
        verifier_name_or_path=str(model_dir),
        draft_vocab_size=cfg.vocab_size,
        norm_before_residual=True,
        ttt_steps=3,
        target_layer_ids=list(layers),
        draft_attn_impl="sdpa",
    )


def test_speculators_trains_toward_what_the_target_predicts(shards, tmp_path, tiny_model_dir):
    trainer("speculators")
    from speculators.train.data import ArrowDataset, CollateFn

    from recipe.shards.trainers import SpeculatorsDataset

    w = final_norm_weight(tiny_model_dir)
    assert (w.float() - 1).abs().mean() > 0.3  # the proof needs norm weights far from 1
    out = tmp_path / "sp"
    info = export("speculators", shards, out)
    assert info["draft_config"]["target_layer_ids"] == [1, 2, 3]
    assert info["draft_config"]["train_args"] == "--target-layer-ids 1 2 3"
    r, direct = ShardReader(shards), SpeculatorsDataset(shards, max_len=4096)
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")  # Arrow rows + hidden_states/hs_i
    assert len(ds) == len(r) == 12 and ds.approx_lengths == direct.approx_lengths
    rows = {row["index"]: row for row in mapping(out).values()}
    for i in range(len(ds)):
        item, x = ds[i], r.get(rows[i]["id"])
        L = x["input_ids"].shape[0]
        assert torch.equal(item["input_ids"], x["input_ids"].long()) and torch.equal(
            item["loss_mask"], x["loss_mask"].long()
        )
        assert torch.equal(item["hidden_states"], x["hidden"][:, :N_AUX].reshape(L, N_AUX * H))
        d = direct[i]
        assert d.keys() == item.keys() and all(torch.equal(d[k], item[k]) for k in d)

    # Their model applies verifier_norm then verifier_lm_head to the last slot: that must give the
    # target's own logits, lm_head(final post-norm state), within bf16 rounding.
    model = speculators_model(tiny_model_dir)
    assert torch.equal(model.verifier_norm.weight.float(), w.float())  # their norm is the target's
    head, norm = model.verifier_lm_head, model.verifier_norm
    agree = agree_wrong = total = 0
    for i in range(len(ds)):
        post = r.get(rows[i]["id"])["hidden"][:, N_AUX]
        with torch.no_grad():
            true = head(post.to(head.weight.dtype)).float()
            theirs = head(norm(ds[i]["verifier_last_hidden_states"].to(head.weight.dtype))).float()
            wrong = head(norm(post.to(head.weight.dtype))).float()  # a post-norm slot: normed twice
        assert torch.allclose(theirs, true, rtol=0.02, atol=0.02 * true.abs().max().item())
        agree += (theirs.argmax(-1) == true.argmax(-1)).sum().item()
        agree_wrong += (wrong.argmax(-1) == true.argmax(-1)).sum().item()
        total += true.shape[0]
    assert agree / total >= 0.995 and agree_wrong / total < 0.9, (agree / total, agree_wrong / total)

    # Two real training steps: their collator, their forward and their eager kl_div loss (the fused
    # one needs Triton) on the CPU; their Trainer moves to CUDA, so the model is called directly.
    from speculators.losses.utils import resolve_loss_config

    batch = CollateFn(max_len=512, hidden_size=H, num_target_layers=N_AUX)([ds[i] for i in range(4)])
    model = model.float()
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    inputs = {k: batch[k].float() if "hidden" in k else batch[k] for k in keys}
    config = resolve_loss_config("kl_div", "eager")
    losses = two_training_steps(model, lambda: model(**inputs, ttt_steps=3, loss_config=config)[1])
    assert losses[1] < losses[0]


def test_speculators_refusal_and_post_norm_modes(shards, tmp_path):
    with pytest.raises(ExportError, match="pre-norm"):
        export("speculators", shards, tmp_path / "sp", final_norm="refuse")
    assert not (tmp_path / "sp").exists() and not list(tmp_path.iterdir())  # nothing left on refusal


# --- export safety and the CLI ----------------------------------------------------------------


def test_export_refuses_a_non_empty_target_and_overwrite_removes_stale_files(shards, tmp_path):
    out = tmp_path / "sf"
    out.mkdir()
    (out / "data_999.ckpt").write_bytes(b"stale")
    with pytest.raises(ExportError, match="--overwrite"):
        export("specforge", shards, out)
    assert sorted(p.name for p in out.iterdir()) == ["data_999.ckpt"]
    export("specforge", shards, out, overwrite=True)
    assert not (out / "data_999.ckpt").exists()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len([p for p in files if p.name.endswith(".ckpt")]) == 12
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files)
    assert not list(tmp_path.glob(".*partial"))


def test_cli_prints_the_draft_config_and_progress(shards, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "recipe.shards", "export", "--to", "speculators", str(shards), str(tmp_path / "sp")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert '"train_args": "--target-layer-ids 1 2 3"' in res.stdout
    assert "export speculators: 12/12 samples" in res.stderr and "MB/s" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "recipe.shards", "export", "--to", "speculators", str(shards), str(tmp_path / "sp")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--overwrite" in res.stderr


def test_a_full_disk_during_export_is_one_line_and_names_it(shards, tmp_path, monkeypatch, capsys):
    import errno

    from recipe.shards.__main__ import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "sf" / "x"))

    monkeypatch.setattr(torch, "save", full)  # each sample's file
    assert main(["export", "--to", "specforge", str(shards), str(tmp_path / "sf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: disk full (") and "run the command again" in err


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_an_export_spread_over_processes_writes_what_one_process_writes(shards, tmp_path, monkeypatch, fmt):
    """Chunks written by spawned workers land in index order: the same files, the same tensors, the
    same samples.jsonl and Arrow rows as the export written in one process."""
    from safetensors.torch import load_file

    import recipe.shards.export as ex

    monkeypatch.setattr(ex, "EXPORT_CHUNK", 5)  # 12 samples: three chunks over two workers
    one, many = tmp_path / "one", tmp_path / "many"
    export(fmt, shards, one, workers=1)
    export(fmt, shards, many, workers=2)
    assert (one / "samples.jsonl").read_text() == (many / "samples.jsonl").read_text()
    rows = [json.loads(x) for x in (many / "samples.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(12)) and [row["id"] for row in rows] == ShardReader(shards).ids

    def sample_files(d):
        return sorted(p.relative_to(d) for p in d.rglob("*") if p.suffix in (".ckpt", ".safetensors"))

    files = sample_files(one)
    assert len(files) == 12 and files == sample_files(many)
    load = (lambda p: torch.load(p, weights_only=True)) if fmt == "specforge" else load_file
    for rel in files:
        a, b = load(one / rel), load(many / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
    if fmt == "speculators":
        import datasets

        x, y = datasets.load_from_disk(str(one)), datasets.load_from_disk(str(many))
        assert x.to_dict() == y.to_dict() and len(x) == 12
        assert y["seq_len"] == [row["tokens"] for row in rows]  # row i beside hs_i, in index order
    with pytest.raises(ExportError, match="--workers 0"):
        export(fmt, shards, tmp_path / "none", workers=0)


def test_an_export_worker_runs_one_torch_thread(shards):
    """Work is split by process: a worker on torch's default (a thread per core) would oversubscribe a
    node that trains beside the export."""
    import recipe.shards.export as ex

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ex._open_worker_reader(str(shards))
        assert torch.get_num_threads() == 1 and len(ex._WORKER_READER) == len(ShardReader(shards))
    finally:
        torch.set_num_threads(before)
        ex._WORKER_READER = None


@pytest.mark.parametrize("fmt,final", [("speculators", "pre-norm-equivalent"), ("speculators", "keep-post-norm"),
                                       ("specforge", "pre-norm-equivalent")])  # fmt: skip
def test_every_exported_tensor_has_the_targets_dtype_and_the_size_its_shape_implies(shards, tmp_path, fmt, final):
    """Activations bf16 as the target computed them (a float32 slot would double the files and hand
    the trainer another dtype), ids and masks int64, each file no larger than its tensors."""
    from safetensors import safe_open

    out = tmp_path / fmt
    export(fmt, shards, out, final_norm=final)
    files = sorted(out.rglob("*.safetensors")) + sorted(out.rglob("*.ckpt"))
    assert files
    want = {"hidden_states": torch.bfloat16, "hidden_state": torch.bfloat16, "aux_hidden_state": torch.bfloat16,
            "token_ids": torch.int64, "input_ids": torch.int64, "loss_mask": torch.int64}  # fmt: skip
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(f, "pt") as g:
                tensors = {k: g.get_tensor(k) for k in g.keys()}
        else:
            tensors = torch.load(f, weights_only=True)
        payload = 0
        for name, t in tensors.items():
            assert t.dtype == want[name], (f.name, name, t.dtype)
            payload += t.numel() * t.element_size()
        assert f.stat().st_size < payload + 64 << 10, (f.name, f.stat().st_size, payload)  # headers only beyond it


def test_speculators_teacher_is_right_for_a_one_plus_w_norm_and_refused_where_speculators_reads_w(tmp_path):
    """Gemma-3's final norm multiplies by (1 + w): the exported last slot through speculators' own
    verifier norm (the class speculators picks for this checkpoint) gives back the stored post-norm state.
    Qwen3-Next's is (1 + w) too, but speculators 0.9.0 applies w: no slot can make its teacher right."""
    trainer("speculators")
    from types import SimpleNamespace

    from speculators.models.utils import GEMMA_STYLE_FINAL_NORM_MODEL_TYPES, resolve_verifier_norm_class

    from recipe.models import materialize
    from recipe.shards.export import SPECULATORS_ZERO_CENTERED
    from recipe.shards.trainers import SpeculatorsDataset

    assert GEMMA_STYLE_FINAL_NORM_MODEL_TYPES == SPECULATORS_ZERO_CENTERED
    for name in ("tiny-gemma-3", "tiny-qwen3-next"):
        cfg = compose([f"output_dir={tmp_path / name}", f"capture.dump_dir={tmp_path / 'shm'}", "data.limit=3",
                       f"model.path=builtin:{name}", "log_every_s=1000"])  # fmt: skip
        run(cfg)
    gemma = materialize("tiny-gemma-3")
    verifier = SimpleNamespace(speculators_config=SimpleNamespace(verifier=SimpleNamespace(name_or_path=str(gemma))))
    norm = resolve_verifier_norm_class(verifier)(H, eps=json.loads((gemma / "config.json").read_text())["rms_norm_eps"])
    norm.load_state_dict({"weight": final_norm_weight(gemma)})
    r, ds = ShardReader(tmp_path / "tiny-gemma-3"), SpeculatorsDataset(tmp_path / "tiny-gemma-3")
    for i, sid in enumerate(r.ids):
        post = r.get(sid)["hidden"][:, N_AUX].float()
        with torch.no_grad():
            theirs = norm(ds[i]["verifier_last_hidden_states"].float())
        assert torch.allclose(theirs, post, rtol=0.02, atol=0.02 * post.abs().max().item())
    with pytest.raises(ExportError, match="qwen3_next's final norm multiplies by \\(1 \\+ w\\), which speculators"):
        export("speculators", tmp_path / "tiny-qwen3-next", tmp_path / "sp")
    assert not (tmp_path / "sp").exists()
