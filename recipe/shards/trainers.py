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

from pathlib import Path

from .export import final_norm_weight, model_dir_of, specforge_raw, speculators_raw
from .reader import ShardReader


class _ShardDataset:
    def __init__(self, root: str | Path):
        self.reader = ShardReader(root)
        self.n_aux = len(self.reader.manifest["capture"]["layers"])
        if not self.reader.manifest["capture"]["final"]:
            raise ValueError(f"{root}: captured with capture.final=false; EAGLE-3 trains toward the final state")

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
        self.norm_weight = final_norm_weight(model_dir_of(self.reader, model_dir))
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
