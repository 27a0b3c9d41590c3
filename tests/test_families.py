"""Every built-in family end to end on the CPU with the HF backend, as `python -m recipe
model.path=builtin:tiny-<family>` runs it: the checkpoint layout loads, each stored slot is nearest its
configured index of the *whole* model's own hidden states (the multimodal wrapper included), the final
slot is the post-norm state, and the loss mask covers the template's assistant turns."""

import json

import numpy as np
import pytest
import torch
from conftest import small_run_cfg

from recipe import data
from recipe.main import run
from recipe.models import BUILTIN, kimi_k25, make_model, materialize
from recipe.shards import ShardReader

FAMILIES = sorted(set(BUILTIN) - {"tiny-llama-256", "tiny-kimi-k2.5-int4"})  # sizes and INT4: tests of their own
LAYERS = [1, 2, 3]
# the published configs' keys that transformers' classes leave out and SGLang 0.5.16 reads
REAL_KEYS = {
    "tiny-gpt-oss": {"swiglu_limit": 7.0},
    "tiny-minimax-m2": {"scoring_func": "sigmoid", "use_routing_bias": True, "rotary_dim": 8},
    "tiny-qwen3-next": {"full_attention_interval": 4},
}


def whole_model(name: str):
    """The checkpoint as its own transformers class (Kimi's wrapper is remote code: its language model)."""
    import transformers

    family, _ = BUILTIN[name]
    if family is kimi_k25:
        return make_model(name).eval()
    return getattr(transformers, family.ARCH).from_pretrained(materialize(name), dtype=torch.bfloat16).eval()


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_runs_end_to_end_and_each_slot_is_nearest_its_hf_index(tmp_path, name):
    remote = f"model.trust_remote_code={BUILTIN[name][0] is kimi_k25}"  # Kimi's tokenizer is its own code
    counts = run(small_run_cfg(tmp_path, f"model.path=builtin:{name}", f"capture.layers={LAYERS}", remote, limit=3))
    assert counts["ok"] == 3 and not counts["failed"]
    r = ShardReader(tmp_path / "out")
    assert r.manifest["model"]["name"] == name
    model = whole_model(name)
    depth = r.manifest["model"]["num_layers"]
    for rec in r.records[:2]:
        x = r.get(rec["id"])
        with torch.inference_mode():
            hs = model(input_ids=x["input_ids"].long()[None], output_hidden_states=True).hidden_states
        assert len(hs) == depth + 1
        for slot, index in enumerate(LAYERS + [depth]):
            d = [rel_l2(x["hidden"][:, slot], h[0]) for h in hs]
            assert int(np.argmin(d)) == index and d[index] < 0.05, (name, slot, [round(v, 3) for v in d])


@pytest.mark.parametrize("name", FAMILIES)
def test_each_familys_template_masks_exactly_its_assistant_turns(name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(materialize(name), trust_remote_code=BUILTIN[name][0] is kimi_k25)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Teal."}, {"role": "user", "content": "And a fruit?"},
            {"role": "assistant", "content": "Quince."}]  # fmt: skip
    ids, mask = data.tokenize(tok, msgs)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    masked = tok.decode(ids[mask == 1])
    assert "Teal." in masked and "Quince." in masked and masked.index("Teal.") < masked.index("Quince.")
    assert not any(s in masked for s in ("Be brief", "Name a colour", "And a fruit")), (name, masked)


@pytest.mark.parametrize("name", sorted(REAL_KEYS))
def test_each_config_carries_what_the_published_one_does(name):
    cfg = json.loads((materialize(name) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    assert {k: cfg.get(k) for k in REAL_KEYS[name]} == REAL_KEYS[name]


def test_the_multimodal_and_hybrid_layouts_are_the_real_ones():
    """Llama-4: the wrapper's class, its language model under `language_model.`, a vision tower beside it;
    Qwen3-Next: linear-attention layers with one full-attention layer; GPT-OSS: sinks and a sliding window."""
    from safetensors import safe_open

    l4 = materialize("tiny-llama-4")
    assert json.loads((l4 / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]
    with safe_open(l4 / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.lm_head.weight" in keys and any(k.startswith("vision_model.") for k in keys)
    nxt = json.loads((materialize("tiny-qwen3-next") / "config.json").read_text())
    assert nxt["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    oss = json.loads((materialize("tiny-gpt-oss") / "config.json").read_text())
    assert "sliding_attention" in oss["layer_types"] and oss["sliding_window"] == 16
    with safe_open(materialize("tiny-gpt-oss") / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.sinks").abs().sum() > 0


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl", "tiny-gemma-4"])
def test_each_multimodal_wrapper_ships_the_processor_files_sglang_loads(name):
    """SGLang builds a multimodal class's processor at start-up, also for token ids alone, and dies without
    its files (seen on an H100): each sub-processor's config resolves to a class, as a real checkpoint's does."""
    from transformers import AutoTokenizer
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.image_processing_base import ImageProcessingMixin

    d = materialize(name)
    image = ImageProcessingMixin.get_image_processor_dict(d)[0]
    assert image["image_processor_type"] in ("Qwen2VLImageProcessor", "Gemma4ImageProcessor")
    if name != "tiny-gemma-4":
        video = json.loads((d / "video_preprocessor_config.json").read_text())
        assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == image["patch_size"]
        return
    assert FeatureExtractionMixin.get_feature_extractor_dict(d)[0]["feature_extractor_type"]
    tok = AutoTokenizer.from_pretrained(d)  # Gemma4Processor reads its markers by name
    assert (tok.image_token, tok.boi_token, tok.eoi_token) == ("<|image|>", "<|image>", "<image|>")
    assert tok.image_token_id == json.loads((d / "config.json").read_text())["image_token_id"]


def rope_values(cfg: dict, key: str) -> set:
    """Every value a text config states for `key` of its global attention: top level, and under
    rope_parameters / rope_scaling (SGLang 0.5.16 reads the top level, transformers 5 rope_parameters);
    per layer type, the full-attention layers' (Gemma-3's sliding layers have a base of their own,
    rope_local_base_freq, checked below)."""
    found = {cfg[key]} if cfg.get(key) is not None else set()
    for nest in ("rope_parameters", "rope_scaling"):
        sub = cfg.get(nest)
        if isinstance(sub, dict) and isinstance(sub.get("full_attention"), dict):
            sub = sub["full_attention"]
        if isinstance(sub, dict) and sub.get(key) is not None:
            found.add(sub[key])
    return found


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_built_in_checkpoint_states_one_rope_base(name):
    cfg = json.loads((materialize(name) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    for key in ("rope_theta", "partial_rotary_factor"):
        assert len(rope_values(text, key)) <= 1, (name, key, rope_values(text, key))
    assert rope_values(text, "rope_theta"), name  # and states one
    local = (text.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):  # the sliding layers' base, as SGLang reads it and as HF does
        assert local.get("rope_theta") == text.get("rope_local_base_freq", local.get("rope_theta")), name
