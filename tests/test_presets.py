"""`capture=dflash` and `capture=dspark`: the layers DFlash's own code picks for the target's depth, in our
numbering (theirs + 1), read from the checkpoint; a one-line refusal where they cannot be taken."""

import ast
import zipfile

import numpy as np
import pytest
import torch
from conftest import small_run_cfg

from recipe.capture.presets import spread
from recipe.main import run
from recipe.schema import ConfigError
from recipe.shards import ShardReader


def sglangs_own(wheel) -> callable:
    """build_target_layer_ids, as the pinned SGLang wheel defines it (DFlash's choice of layers)."""
    with zipfile.ZipFile(wheel) as z:
        src = z.read("sglang/srt/speculative/dflash_utils.py").decode()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "build_target_layer_ids")
    scope = {"List": list}
    exec(compile(ast.Module([fn], []), "dflash_utils", "exec"), scope)
    return scope["build_target_layer_ids"]


def test_the_spread_is_dflashs_own_choice_plus_one(sglang_wheel):
    theirs = sglangs_own(sglang_wheel)
    for n in range(4, 130):
        for k in range(1, 9):
            assert spread(n, k) == [j + 1 for j in theirs(n, k)], (n, k)


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A 10-layer Llama with the built-in tokenizer: deep enough for 5 distinct DFlash layers."""
    import transformers

    from recipe.models import common, make_tokenizer

    dest = tmp_path_factory.mktemp("deep-llama")
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=common.vocab_size(["x"] * 8), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=10, num_attention_heads=2, num_key_value_heads=1,
                                   **common.token_ids(tok))  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    common.randomize(model)
    common.save(model, tok, dest)
    return dest


@pytest.mark.parametrize("preset, final", [("dflash", False), ("dspark", True)])
def test_a_preset_stores_the_spread_layers_of_the_checkpoints_depth(tmp_path, deep_llama, preset, final):
    counts = run(small_run_cfg(tmp_path, f"capture={preset}", f"model.path={deep_llama}", limit=2))
    assert counts["ok"] == 2
    r = ShardReader(tmp_path / "out")
    want = spread(10, 5)
    assert want == [2, 3, 5, 7, 8] and r.manifest["capture"]["layers"] == want
    assert r.slots == [f"layer_{i}" for i in want] + (["final_post_norm"] if final else [])
    from recipe.backends.hf import load_causal_lm

    x = r.get(r.ids[0])
    with torch.inference_mode():
        hs = load_causal_lm(deep_llama, torch.bfloat16)(input_ids=x["input_ids"].long()[None],
                                                         output_hidden_states=True).hidden_states  # fmt: skip
    for slot, i in enumerate(want):
        d = [float((x["hidden"][:, slot].float() - h[0].float()).norm()) for h in hs]
        assert int(np.argmin(d)) == i


def test_a_preset_is_refused_in_one_line_where_it_cannot_be_taken(tmp_path, deep_llama):
    with pytest.raises(ConfigError, match=r"capture.spread=5 needs a model of at least 8 layers; this one has 4"):
        run(small_run_cfg(tmp_path / "a", "capture=dflash"))  # tiny-llama: 4 layers
    with pytest.raises(ConfigError, match=r"capture.spread=5 and capture.layers=\[1, 2\]: give one"):
        run(small_run_cfg(tmp_path / "b", "capture=dflash", "capture.layers=[1,2]", f"model.path={deep_llama}"))
    assert not (tmp_path / "a" / "out").exists() and not (tmp_path / "b" / "out").exists()  # before any writing
