"""HF transformers backend: the reference, and the CPU path of the embedded default.

Layer convention (the same as the SGLang hook's): slot for layer i = the residual stream entering
decoder layer i = HF `output_hidden_states[i]` (0 = embeddings); the final slot is
`output_hidden_states[num_layers]`, which HF returns *after* the final norm.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from ..capture.writer import CaptureWriter
from ..int4 import quantization_of, write_dequantized
from ..schema import CaptureConfig, HFBackendConfig

log = logging.getLogger(__name__)
# what a multimodal checkpoint holds beside its language model: Kimi-K2.5's, Llama-4's, and transformers
# 5's wrappers' (Qwen3.5's `model.visual.`, Gemma-4's `model.vision_tower.` and `model.embed_vision.`)
VISION = ("vision_tower.", "mm_projector.", "vision_model.", "multi_modal_projector.", "model.visual.",
          "model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")  # fmt: skip
# where a wrapper keeps its language model: Kimi-K2.5 and Llama-4 under `language_model.`, transformers 5's
# under `model.language_model.` (Qwen3.5's text class maps that itself, Gemma-4's does not); the text
# model's own class names it `model.`
LANGUAGE_MODEL = {r"^model\.language_model\.": "model.", r"^language_model\.": ""}


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


def load_causal_lm(model_dir, dtype, **kw):
    """A causal LM, or the language model inside a multimodal checkpoint (Kimi-K2.5: config under
    `text_config`, weights under `language_model.`), which AutoModelForCausalLM does not open."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    outer = json.loads((Path(model_dir) / "config.json").read_text())
    if "text_config" not in outer:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    # transformers' own loader, not load_state_dict: it turns the checkpoint's per-expert names into
    # the fused experts its MoE modules hold. The vision tower is not ours to load: its keys are
    # expected leftovers, and the load report listing them is silenced.
    # INT4 routed experts (Kimi-K2.5 as shipped) are read as the bf16 weights they stand for, so HF
    # computes the model SGLang serves: dequantized into a temporary folder, loaded from there.
    text = dict(outer["text_config"])
    if not has_causal_lm(text):  # Qwen3-VL: transformers has no causal LM for its text model alone
        return whole_wrapper(model_dir, outer, dtype, **kw)
    quantized = quantization_of(text)
    text.pop("quantization_config", None)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory(prefix="hs-recipe-dequantized-") as tmp:
            if quantized:
                log.info("dequantizing %s's INT4 experts to %s for the HF backend", model_dir, dtype)
                write_dequantized(model_dir, Path(tmp))
                (Path(tmp) / "config.json").write_text(json.dumps(text))
            model, info = AutoModelForCausalLM.from_pretrained(
                tmp if quantized else model_dir,
                config=AutoConfig.for_model(**text),
                dtype=dtype,
                key_mapping=LANGUAGE_MODEL,
                output_loading_info=True,
                **kw,
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    foreign = [k for k in info["unexpected_keys"] if not k.startswith(VISION)]
    if info["missing_keys"] or foreign or info["mismatched_keys"]:
        raise RuntimeError(
            f"{model_dir}: language_model.* weights do not fit {type(model).__name__}: "
            f"missing {sorted(info['missing_keys'])[:3]}, unexpected {sorted(foreign)[:3]}, "
            f"mismatched {list(info['mismatched_keys'])[:3]}"
        )
    return model


def has_causal_lm(text: dict) -> bool:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(AutoConfig.for_model(**text)) in MODEL_FOR_CAUSAL_LM_MAPPING


def whole_wrapper(model_dir, outer: dict, dtype, **kw):
    """The checkpoint's own multimodal class, vision tower and all: text-only input runs its language
    model alone, and its hidden states are that model's."""
    import transformers

    arch = (outer.get("architectures") or [""])[0]
    if not hasattr(transformers, arch):
        raise RuntimeError(f"{model_dir}: transformers has no class {arch!r} to load this checkpoint with")
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype, **kw)


class HFBackend:
    def __init__(
        self,
        model_dir,
        layers: list[int],
        final: bool,
        device: str = HFBackendConfig.device,  # defaults: the schema's, one home for each
        dtype: str = "bfloat16",
        batch_tokens: int = HFBackendConfig.batch_tokens,
        batch_size: int = HFBackendConfig.batch_size,
        attn_implementation: str | None = HFBackendConfig.attn_implementation,
        budget_bytes: int = 0,
        dump_dir=None,  # where run() writes each batch (as the server would); None: hidden_states() only
        rid_prefix: str = CaptureConfig.rid_prefix,
    ):
        import torch

        self.torch = torch
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 1e9
        log.info("loading %s (%.2f GB of weights) onto %s", model_dir, size, self.device)
        t0 = time.monotonic()
        self.model = load_causal_lm(model_dir, getattr(torch, dtype), **kw).to(self.device).eval()
        log.info("model loaded in %.1f s", time.monotonic() - t0)
        text = self.model.config.get_text_config()  # a multimodal wrapper's language model's
        self.num_layers = text.num_hidden_layers
        self.layers, self.final = list(layers), final
        self.batch_tokens, self.batch_size = batch_tokens, batch_size
        # a batch is written into the dump folder as one pass: keep it within the dump budget
        per_token = (len(self.layers) + int(final)) * text.hidden_size * 2 + 5
        if budget_bytes:
            self.batch_tokens = max(1, min(batch_tokens, budget_bytes // per_token))
        self.rid_prefix = rid_prefix
        self.writer = CaptureWriter(dump_dir, budget_bytes or 1 << 62, rid_prefix) if dump_dir is not None else None

    @classmethod
    def from_config(cls, model_dir, dump_dir, output_dir, *, backend, capture, model) -> "HFBackend":
        """Reads the `backend`, `capture` and `model` nodes; writes into the dump folder through the
        capture writer, as the server's hook does (the output folder is not its concern)."""
        return cls(
            model_dir,
            list(capture.layers),
            capture.final,
            device=backend.device,
            dtype=model.dtype,
            batch_tokens=backend.batch_tokens,
            batch_size=backend.batch_size,
            attn_implementation=backend.attn_implementation,
            budget_bytes=int(capture.budget_gb * (1 << 30)),
            dump_dir=dump_dir,
            rid_prefix=capture.rid_prefix,
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

    def generate(self, prompt: list[int], seed: int, regen, stop: int) -> list[int]:
        """The target's answer to `prompt` as token ids, sampled with data.regenerate's settings and
        this turn's seed; it ends with `stop` unless it reached max_new_tokens."""
        torch = self.torch
        torch.manual_seed(seed)
        ids = torch.as_tensor([prompt], dtype=torch.long, device=self.device)
        sample = regen.temperature > 0
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=regen.max_new_tokens,
                do_sample=sample, temperature=regen.temperature if sample else None,
                top_p=regen.top_p if sample else None, top_k=None, eos_token_id=stop, pad_token_id=stop,
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def run(self, samples, sink, should_stop=lambda: False) -> None:
        if self.writer is None:
            raise RuntimeError("HFBackend.run needs dump_dir: it writes each batch there as the server would")
        sink.progress.start()  # the model is loaded: rates count the capture
        for batch in batches(samples, self.batch_tokens, self.batch_size):
            if should_stop():
                return
            rids = [f"{self.rid_prefix}{s.id}" for s in batch]
            for rid, s in zip(rids, batch):
                sink.expect(rid, s)
            try:
                rows = self.hidden_states([s.input_ids for s in batch])
            except Exception as e:  # e.g. OOM on one batch: its samples fail, the run goes on
                log.exception("forward failed for a batch of %d", len(batch))
                for rid in rids:
                    sink.fail(rid, f"forward_error: {type(e).__name__}: {e}")
                continue
            lens = [len(s.input_ids) for s in batch]
            # one pass, rows concatenated in request order: exactly how an SGLang EXTEND batch arrives
            self.writer.write_pass(
                rids,
                [0] * len(batch),
                lens,
                np.concatenate([s.input_ids for s in batch]),
                self.torch.cat(rows),
                lasts=[True] * len(batch),
            )
            for rid in rids:
                sink.responded(rid)

    def close(self) -> None:
        self.model = None
