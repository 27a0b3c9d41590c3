"""Kimi-K2.5's layout on the CPU: builtin:tiny-kimi-k2.5 (recipe/models/kimi_k25.py) through the recipe
with the HF backend. The same checkpoint is served by SGLang's Kimi wrapper in tests/gpu."""

import json
import shutil

import numpy as np
import pytest
from conftest import ROOT, small_run_cfg

from recipe import data
from recipe.main import run
from recipe.models import materialize
from recipe.shards import ShardReader
from recipe.shards.verify import verify

KIMI = ["model.path=builtin:tiny-kimi-k2.5", "model.name=tiny-kimi-k2.5", "model.default_layers=[1,2,3]"]


@pytest.fixture(scope="module")
def kimi_dir(_cache):
    return materialize("tiny-kimi-k2.5")


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)


def kimi_chat(path):
    """The bundled conversations, every assistant turn with reasoning (Kimi's template drops it
    from a turn once a later user turn follows)."""
    with open(ROOT / "recipe" / "assets" / "tiny-chat.jsonl") as f, open(path, "w") as out:
        for line in f:
            rec = json.loads(line)
            for m in rec.get("messages", []):
                if m["role"] == "assistant":
                    m["reasoning_content"] = "Think: " + m["content"][:40]
            out.write(json.dumps(rec) + "\n")
    return path


def test_the_layout_is_kimi_k25s(kimi_dir):
    from safetensors import safe_open

    cfg = json.loads((kimi_dir / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and cfg["text_config"]["kv_lora_rank"] > 0
    assert cfg["vision_config"]["vt_hidden_size"] == cfg["vision_config"]["hidden_size"]
    with safe_open(kimi_dir / "model.safetensors", "pt") as st:
        keys = list(st.keys())
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "mm_projector"}
    # each routed expert under its own name, as in the real checkpoint (and what SGLang loads);
    # transformers 5's in-memory fused names (`experts.gate_up_proj`) served an MoE without experts
    n_experts = cfg["text_config"]["n_routed_experts"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for e in range(n_experts):
            assert f"language_model.model.layers.1.mlp.experts.{e}.{proj}.weight" in keys
    assert not [k for k in keys if ".experts.gate_up_proj" in k or k.endswith(".experts.down_proj")]
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in keys and "mm_projector.proj.2.weight" in keys
    tc = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert tc["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"


def test_hf_reads_the_language_model_out_of_the_kimi_layout(kimi_dir, tmp_path):
    """The HF reference the GPU proof compares SGLang with: every language weight of the Kimi layout
    lands where the tiny DeepSeek-V3 it was written from has it, and a weight that does not fit fails."""
    import torch
    from safetensors.torch import load_file, save_file

    from recipe.backends.hf import load_causal_lm
    from recipe.models import make_model

    got = load_causal_lm(kimi_dir, torch.bfloat16).state_dict()
    want = make_model("tiny-deepseek-v3").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    broken = tmp_path / "tiny-kimi-broken"
    shutil.copytree(kimi_dir, broken)
    tensors = load_file(kimi_dir / "model.safetensors")
    for gone, says in [
        ("language_model.model.layers.1.self_attn.o_proj.weight", "missing .*o_proj"),
        ("language_model.model.layers.1.mlp.experts.3.up_proj.weight", "conversion of the weights"),
    ]:
        save_file({k: t for k, t in tensors.items() if k != gone}, broken / "model.safetensors")
        with pytest.raises(RuntimeError, match=says):
            load_causal_lm(broken, torch.bfloat16)


def test_the_tokenizer_loads_only_through_remote_code(kimi_dir, kimi_tok):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(kimi_dir)
    assert type(kimi_tok).__name__ == "TikTokenTokenizer" and not kimi_tok.is_fast  # a slow class, as Kimi's


def test_without_trust_remote_code_the_run_says_what_to_set(tmp_path):
    from recipe.schema import ConfigError

    with pytest.raises(ConfigError, match="model.trust_remote_code=true"):
        run(small_run_cfg(tmp_path, *KIMI, limit=2))


def test_depth_and_width_come_from_text_config(tmp_path):
    from recipe.main import ModelShape, read_model_shape, resolve_model_path
    from recipe.schema import ConfigError

    cfg = small_run_cfg(tmp_path, *KIMI, "model.trust_remote_code=true", "dry_run=true", limit=2)
    run(cfg)
    assert read_model_shape(cfg, resolve_model_path(cfg.model.path)) == ModelShape(num_layers=4, hidden_size=256)
    assert cfg.model.num_layers is None  # the config is left as written
    with pytest.raises(
        ConfigError, match=r"model.num_layers=61 but .*config.json \(text_config\) says num_hidden_layers=4"
    ):
        run(small_run_cfg(tmp_path / "b", *KIMI, "model.trust_remote_code=true", "model.num_layers=61", limit=2))
    with pytest.raises(ConfigError, match="out of range for 4 layers"):
        run(small_run_cfg(tmp_path / "c", *KIMI, "model.trust_remote_code=true", "capture.layers=[1,5]", limit=2))


def test_multi_turn_masks_survive_a_template_that_drops_earlier_reasoning(tmp_path, kimi_tok):
    """Kimi renders an earlier turn without its reasoning once a later user turn follows, so no
    prefix of the conversation renders as the whole does. Every multi-turn sample must still get a
    mask, and that mask must cover exactly each assistant turn as the whole conversation renders it."""
    msgs_all = [data.to_messages(json.loads(x)) for x in open(kimi_chat(tmp_path / "k.jsonl"))]
    multi = [m for m in msgs_all if sum(x["role"] == "assistant" for x in m) > 1]
    strict = sum(  # the old rule: every prefix a prefix of the whole
        all(
            data.render(kimi_tok, m, False).startswith(data.render(kimi_tok, m[: k + 1], False))
            for k, x in enumerate(m)
            if x["role"] == "assistant"
        )
        for m in multi
    )
    ok = 0
    for m in multi:
        ids, mask = data.tokenize(kimi_tok, m)
        masked = kimi_tok.decode([int(i) for i, b in zip(ids, mask) if b])
        # history turns: their answer only (reasoning dropped); the last turn: its reasoning and answer
        want = "".join(
            (x.get("reasoning_content", "") if k == len(m) - 1 else "") + "</think>" + x["content"] + "<|im_end|>"
            for k, x in enumerate(m)
            if x["role"] == "assistant"
        )
        ok += masked == want
    # bundled data: 23 multi-turn conversations; 5 survive the old rule (those ending on a user turn,
    # where no turn is rewritten), all 23 now, each with the exact mask
    assert len(multi) >= 20 and strict <= len(multi) // 4 and ok == len(multi), (len(multi), strict, ok)


def test_instant_mode_renders_empty_thinking(tmp_path, kimi_tok):
    m = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"}]
    assert data.render(kimi_tok, m[:1], True, {"thinking": False}).endswith("<think></think>")
    ids, mask = data.tokenize(kimi_tok, m, {"thinking": False})
    assert kimi_tok.decode([int(i) for i, b in zip(ids, mask) if b]) == "yo<|im_end|>"


def test_the_recipe_runs_on_the_kimi_layout_and_records_its_remote_code(tmp_path, kimi_tok):
    chat = kimi_chat(tmp_path / "k.jsonl")
    cfg = small_run_cfg(tmp_path, *KIMI, "model.trust_remote_code=true", f"data.sources=[{chat}]", limit=40)
    counts = run(cfg)
    out = tmp_path / "out"
    assert counts["ok"] == counts["input"] == 40 and verify(out) == []
    reader = ShardReader(out)
    assert set(reader.manifest["tokenizer"]["remote_code"]) == {"tokenization_kimi.py", "processing_kimi_k25.py"}
    for line in open(chat):
        msgs = data.to_messages(json.loads(line))
        ids, mask = data.tokenize(kimi_tok, msgs)
        ids, mask = ids[: cfg.data.max_length], mask[: cfg.data.max_length]  # the run truncates past it
        x = reader.get(data.sample_id(msgs))
        assert np.array_equal(x["input_ids"].numpy(), ids) and np.array_equal(x["loss_mask"].numpy(), mask)


def test_preflight_estimates_kimi_scale_disk(caplog):
    """10K samples of 1,611 tokens on Kimi-K2.5 (3 layers + final, hidden 7168) are about 924 GB raw."""
    import logging
    from types import SimpleNamespace

    from recipe import preflight

    samples = [SimpleNamespace(input_ids=np.zeros(1611, np.int32))] * 10_000
    raw, stored = preflight.estimate(samples, 4, 7168)
    assert round(raw / 1e9) == 924 and stored == int(raw / preflight.ASSUMED_RATIO)
    with caplog.at_level(logging.INFO, logger="recipe.preflight"):
        with pytest.raises(preflight.PreflightError):  # no test machine has 770 GB free
            preflight.check(samples, 4, 7168, "/tmp", "/tmp", 1.0)
    assert "raw 924 GB, stored about 638 GB at the 1.45x" in caplog.text
