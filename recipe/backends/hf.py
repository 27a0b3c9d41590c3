"""HF transformers backend: the reference, and the CPU path of the embedded default.

Layer convention (the same as the SGLang hook's): slot for layer i = the residual stream entering
decoder layer i = HF `output_hidden_states[i]` (0 = embeddings); the final slot is
`output_hidden_states[num_layers]`, which HF returns *after* the final norm.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def batches(samples, max_tokens: int, max_size: int):
    """Length-sorted batches whose padded size (count x longest) stays within max_tokens."""
    order = sorted(samples, key=lambda s: len(s.input_ids))
    batch, longest = [], 0
    for s in order:
        n = len(s.input_ids)
        if batch and (max(longest, n) * (len(batch) + 1) > max_tokens or len(batch) >= max_size):
            yield batch
            batch, longest = [], 0
        batch.append(s)
        longest = max(longest, n)
    if batch:
        yield batch


class HFBackend:
    def __init__(
        self,
        model_dir,
        layers: list[int],
        final: bool,
        device: str = "auto",
        dtype: str = "bfloat16",
        batch_tokens: int = 8192,
        batch_size: int = 16,
        attn_implementation: str | None = None,
    ):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **kw).to(self.device).eval()
        )
        self.num_layers = self.model.config.num_hidden_layers
        self.layers, self.final = list(layers), final
        self.batch_tokens, self.batch_size = batch_tokens, batch_size

    @classmethod
    def from_config(cls, backend, capture, model, model_dir) -> "HFBackend":
        return cls(
            model_dir,
            list(capture.layers),
            capture.final,
            device=backend.device,
            dtype=model.dtype,
            batch_tokens=backend.batch_tokens,
            batch_size=backend.batch_size,
            attn_implementation=backend.attn_implementation,
        )

    def __enter__(self) -> "HFBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hidden_states(self, input_ids_list):
        """-> list of [n_i, slots, H] tensors (CPU), one per sequence, padding removed."""
        torch = self.torch
        lens = [len(x) for x in input_ids_list]
        T = max(lens)
        ids = torch.zeros((len(lens), T), dtype=torch.long)
        att = torch.zeros((len(lens), T), dtype=torch.long)
        for i, x in enumerate(input_ids_list):  # right padding: real tokens keep positions 0..n-1
            ids[i, : lens[i]] = torch.as_tensor(np.asarray(x, dtype=np.int64))
            att[i, : lens[i]] = 1
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=att.to(self.device),
                output_hidden_states=True,
                use_cache=False,
                logits_to_keep=1,
            )
        hs = out.hidden_states
        if len(hs) != self.num_layers + 1:
            raise RuntimeError(f"model returned {len(hs)} hidden states for {self.num_layers} layers")
        picks = [hs[i] for i in self.layers] + ([hs[self.num_layers]] if self.final else [])
        stacked = torch.stack(picks, dim=2)  # [B, T, slots, H]
        return [stacked[i, : lens[i]].to("cpu") for i in range(len(lens))]

    def run(self, samples, packer, writer, rid_of, should_stop=lambda: False) -> None:
        for batch in batches(samples, self.batch_tokens, self.batch_size):
            if should_stop():
                return
            rids = [rid_of(s) for s in batch]
            for rid, s in zip(rids, batch):
                packer.expect(rid, s)
            try:
                rows = self.hidden_states([s.input_ids for s in batch])
            except Exception as e:  # e.g. OOM on one batch: its samples fail, the run goes on
                log.exception("forward failed for a batch of %d", len(batch))
                for rid in rids:
                    packer.fail(rid, f"forward_error: {type(e).__name__}: {e}")
                continue
            lens = [len(s.input_ids) for s in batch]
            # one pass, rows concatenated in request order: exactly how an SGLang EXTEND batch arrives
            writer.write_pass(
                rids,
                [0] * len(batch),
                lens,
                np.concatenate([s.input_ids for s in batch]),
                self.torch.cat(rows),
                lasts=[True] * len(batch),
            )
            for rid in rids:
                packer.responded(rid)

    def close(self) -> None:
        self.model = None
