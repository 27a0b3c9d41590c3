"""Train straight from shards: map-style datasets that yield exactly the item each trainer's own
collator expects, so a terabyte-scale run needs no second copy in the trainer's file format.

    from recipe.shards.trainers import SpecForgeDataset, SpeculatorsDataset
    ds = SpecForgeDataset("OUT", max_len=2048)       # + specforge.data.utils.DataCollatorWithPadding()
    ds = SpeculatorsDataset("OUT", max_len=2048)     # + speculators.train.data.CollateFn(...)

Each item is built from the same per-sample record the exporter writes (`export.specforge_raw`,
`export.speculators_raw`) and then passed through the trainer's own code (SpecForge's offline
normalizer; speculators' BaseDataset.__getitem__), imported from the installed trainer. The tests
check item for item that these equal the trainer's dataset over an export.
Classes live at module level so the datasets pickle into spawn/forkserver DataLoader workers.
"""

from __future__ import annotations

import json
from pathlib import Path

from .export import ExportError, final_norm_gain, model_dir_of, specforge_file, specforge_raw, speculators_raw
from .reader import ShardReader


class _ShardDataset:
    def __init__(self, root: str | Path):
        self.reader = ShardReader(root)
        self.n_aux = len(self.reader.manifest["capture"]["layers"])
        if not self.reader.manifest["capture"]["final"]:
            raise ExportError(f"{root}: captured with capture.final=false; EAGLE-3 trains toward the final state")

    def __len__(self) -> int:
        return len(self.reader)

    def sample(self, i: int) -> dict:
        return self.reader.get(self.reader.records[i]["id"])


class SpecForgeDataset(_ShardDataset):
    """= specforge's OfflineEagle3Dataset over an export (same item, same index order as samples.jsonl)."""

    def __init__(self, root: str | Path, max_len: int = 2048):
        super().__init__(root)
        self.max_len = max_len

    def __getitem__(self, i: int) -> dict:
        from specforge.algorithms.eagle3.data import normalize_offline_sample

        return normalize_offline_sample(specforge_raw(self.sample(i), self.n_aux), self.max_len)


class SpeculatorsDataset(_ShardDataset):
    """= speculators' ArrowDataset over an export: hidden_states [L, K*H], input_ids, the pre-norm
    equivalent final state as verifier_last_hidden_states, loss_mask, lengths, position_ids."""

    def __init__(self, root: str | Path, max_len: int = 2048, model_dir: str | Path | None = None):
        super().__init__(root)
        self.max_len = max_len
        self.norm_weight = final_norm_gain(model_dir_of(self.reader, model_dir))
        self.approx_lengths = [r["tokens"] for r in self.reader.records]  # its batch sampler reads this

    def _get_raw_data(self, i: int) -> dict:
        x = self.sample(i)
        hs = speculators_raw(x, self.n_aux, "pre-norm-equivalent", self.norm_weight)["hidden_states"]
        return {
            "hidden_states": hs[:, :-1].flatten(1),
            "input_ids": x["input_ids"].long(),
            "verifier_last_hidden_states": hs[:, -1],
            "loss_mask": x["loss_mask"].long(),
        }

    def __getitem__(self, i: int) -> dict:
        from speculators.train.data import BaseDataset

        return BaseDataset.__getitem__(self, i)  # theirs adds lengths and position_ids


# --- SpecForge's own trainer (`specforge train`) reading shards, no export -------------------

SHARD_REF = "#sample-"  # a feature "file" path that names one sample of a shard set: ROOT#sample-I


def _is_shard_set(path) -> bool:
    return (Path(path) / "manifest.json").exists() and (Path(path) / "index.jsonl").exists()


class _ShardFiles:
    """Stands in for SpecForge's two offline file functions: list_feature_files(path) and
    load_feature_file(path). A shard set lists as ROOT#sample-I, I = the sample's number in an export
    (index order), in the order SpecForge lists that export's files (sorted paths: data_0, data_1,
    data_10, ...), so its seeded sampler draws the same samples in the same steps as over an export.
    Anything else goes to SpecForge's own functions unchanged."""

    def __init__(self, list_files, load_file, item):
        self.list_files, self.load_file, self.item = list_files, load_file, item
        self.datasets: dict[str, _ShardDataset] = {}

    def dataset(self, root: str) -> _ShardDataset:
        if root not in self.datasets:
            self.datasets[root] = _ShardDataset(root)
        return self.datasets[root]

    def list(self, path):
        if not _is_shard_set(path):
            return self.list_files(path)
        root = str(Path(path).resolve())
        order = sorted(range(len(self.dataset(root))), key=specforge_file)
        return [f"{root}{SHARD_REF}{i}" for i in order]

    def load(self, path):
        if SHARD_REF not in str(path):
            return self.load_file(path)
        root, i = str(path).rsplit(SHARD_REF, 1)
        ds = self.dataset(root)
        return self.item(ds.sample(int(i)), ds.n_aux)


def shard_counter(root: str, max_length: int | None = None):
    """The set's loss-masked token counts as SpecForge counts them for its vocabulary mapping: a Counter
    in first-seen order over the samples in index order, each cut to max_length as its reader cuts it;
    and what identifies them (SpecForge keys its mapping cache with it)."""
    from collections import Counter

    from . import tokencounts

    reader = ShardReader(root)
    longest = max((r["tokens"] for r in reader.records), default=0)
    if max_length is None or longest <= max_length:
        counts = tokencounts.load(reader.root, reader.records)
    else:
        counts = tokencounts.within(reader.root, reader.records, max_length)
    ids, freq = counts.counter()
    identity = {"kind": "hs-recipe-shards-v1", "root": str(reader.root.resolve()), "samples": counts.lines,
                "digest": tokencounts.digest_of(reader.records).hex(), "max_length": max_length}  # fmt: skip
    return Counter(dict(zip(ids.tolist(), freq.tolist()))), identity


def _mapping_from_shards(original):
    """SpecForge's offline vocabulary mapping, with the counts a shard set keeps in place of the ones it
    would read from feature files (which a shard set does not have): the same Counter, then SpecForge's
    own install (its rule, its cache keyed by this identity, its buffers)."""

    def ensure(cfg, bundle, algorithm):
        path = cfg.data.hidden_states_path
        draft, target = bundle.draft_vocab_size, bundle.target_vocab_size
        if not _is_shard_set(path) or cfg.model.vocab_mapping_path or draft == target:
            return original(cfg, bundle, algorithm)
        from specforge.training.assembly import _install_dataset_vocab_mapping

        counter, identity = shard_counter(path, cfg.data.max_length)
        _install_dataset_vocab_mapping(
            cfg, bundle, counts=counter, dataset_identity=json.dumps(identity, sort_keys=True)
        )

    return ensure


class specforge_reads_shards:
    """Within this block, SpecForge's offline trainer reads a shard set named as
    `data.hidden_states_path` directly: each feature "file" is one sample, built by the same
    `specforge_raw` the exporter writes (so the loss curve equals training on an export), and every
    other step (sampler, normalizer, collator, training) is SpecForge's own. A draft vocabulary smaller
    than the target's is mapped from the set's own token counts (`shard_counter`, in index order)
    through SpecForge's own mapping code: the mapping vocab-map writes for the same set.

        with specforge_reads_shards():
            specforge.cli.main(["train", "-c", "run.yaml"])   # data.hidden_states_path: OUT

    `item(sample, n_aux) -> dict` replaces `specforge_raw` (the draft benchmark's controls use it).
    DataLoader workers must be forked (Linux's default) to inherit the swap."""

    def __init__(self, item=specforge_raw):
        self.item = item

    def __enter__(self):
        from specforge.runtime.data_plane import feature_store, offline_reader
        from specforge.training import assembly

        self._mods = (offline_reader, feature_store, assembly)
        self._saved = (offline_reader.list_feature_files, feature_store.load_feature_file,
                       assembly._ensure_offline_vocab_mapping)  # fmt: skip
        files = _ShardFiles(*self._saved[:2], self.item)
        offline_reader.list_feature_files, feature_store.load_feature_file = files.list, files.load
        assembly._ensure_offline_vocab_mapping = _mapping_from_shards(self._saved[2])
        return files

    def __exit__(self, *exc):
        (offline_reader, feature_store, assembly), (lst, load, mapping) = self._mods, self._saved
        offline_reader.list_feature_files, feature_store.load_feature_file = lst, load
        assembly._ensure_offline_vocab_mapping = mapping
        return False
