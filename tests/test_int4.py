"""Kimi-K2.5's INT4 routed experts on the CPU: builtin:tiny-kimi-k2.5-int4 is laid out as the real
checkpoint (names, dtypes, shapes, quantization_config judged by compressed-tensors' own matcher),
the HF backend reads it as the bf16 weights it stands for, and `python -m recipe` runs on it.
The same checkpoint is served by SGLang's compressed-tensors MoE method in tests/gpu."""

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from recipe import int4
from recipe.errors import ModelDirError
from recipe.models import materialize

LINEAR = re.compile(r"(_proj|_proj_with_mqa|lm_head)\.weight$")


@pytest.fixture(scope="module")
def dirs(_cache):
    return materialize("tiny-kimi-k2.5-int4"), materialize("tiny-kimi-k2.5")


def test_only_the_routed_experts_are_int4_named_and_shaped_as_the_real_checkpoint(dirs):
    from compressed_tensors.utils import match_name

    q_dir, bf16_dir = dirs
    cfg = json.loads((q_dir / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert "quantization_config" not in cfg  # under text_config, where SGLang's KimiK25Config reads it
    qc = cfg["text_config"]["quantization_config"]
    assert qc == int4.QUANTIZATION_CONFIG
    q, ref = load_file(q_dir / "model.safetensors"), load_file(bf16_dir / "model.safetensors")
    quantized = set()
    for name, w in ref.items():
        # SGLang builds the language model without the `language_model.` prefix for compressed-tensors,
        # so the ignore list is matched against these names (the vision tower gets no quant config)
        module = name.removeprefix("language_model.").removesuffix(".weight")
        linear = name.startswith("language_model.") and LINEAR.search(name)
        if linear and not any(match_name(module, ig) for ig in qc["ignore"]):
            base = name.removesuffix("weight")
            quantized.add(name)
            out, inp = w.shape
            assert name not in q
            assert q[base + "weight_packed"].dtype == torch.int32 and q[base + "weight_packed"].shape == (out, inp // 8)
            assert q[base + "weight_scale"].dtype == torch.bfloat16
            assert q[base + "weight_scale"].shape == (out, inp // int4.GROUP)
            assert q[base + "weight_shape"].tolist() == [out, inp]
        else:
            assert torch.equal(q[name], w), f"{name} changed, but it is not a routed expert"
    experts = {n for n in ref if int4.ROUTED_EXPERT.search(n)}
    assert quantized == experts and len(experts) == 3 * 8 * 3  # 3 MoE layers x 8 experts x gate/up/down
    assert len(q) == len(ref) + 2 * len(experts)


def test_our_dequantization_is_compressed_tensors_own_bit_for_bit(dirs):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = int4.QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    q, ref = load_file(dirs[0] / "model.safetensors"), load_file(dirs[1] / "model.safetensors")
    for name in sorted(n for n in ref if int4.ROUTED_EXPERT.search(n)):
        base = name.removesuffix("weight")
        packed = {k: q[base + k] for k in int4.PACKED}
        ours = int4.dequantize(*packed.values())
        theirs = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
        assert torch.equal(ours, theirs), name
        # and it is the bf16 weight, to INT4 rounding: half a step of its group's scale, plus the scale's
        # own bf16 rounding (2^-8 relative, times up to 8 steps) and the result's (2^-9 x 8 steps)
        step = packed["weight_scale"].float().repeat_interleave(int4.GROUP, dim=1)
        assert ((ours.float() - ref[name].float()).abs() <= (0.5 + 8 / 256 + 8 / 512) * step).all(), name


def test_the_hf_backend_reads_int4_experts_as_their_bf16_weights(dirs):
    """Entering layer 1 (after the dense layer 0) equals the bf16 model's bit for bit; from the first
    MoE layer on the states move by the INT4 rounding of the experts: a few percent, not zero."""
    from recipe.backends.hf import load_causal_lm

    ids = torch.arange(10, 74).unsqueeze(0)
    with torch.no_grad():
        hq, hb = (load_causal_lm(d, torch.bfloat16)(ids, output_hidden_states=True).hidden_states for d in dirs)
    rel = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(hq, hb)]
    assert rel[0] == rel[1] == 0.0
    assert all(0.001 < r < 0.1 for r in rel[2:]), rel


def test_an_unsupported_quantization_is_refused_in_one_line():
    fp8 = {"quantization_config": {"quant_method": "fp8", "format": "float-quantized"}}
    with pytest.raises(ModelDirError, match="use backend=sglang"):
        int4.quantization_of(fp8)
    assert int4.quantization_of({}) is None


def test_python_m_recipe_runs_the_kimi_experiment_model_on_int4_with_the_hf_backend(dirs, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "recipe", "model=kimi-k2.5", "model.path=builtin:tiny-kimi-k2.5-int4", "backend=hf"]
    # a 4-layer model cannot take Kimi-K2.5's layers 3, 31, 59: the user names layers that exist
    cmd += ["capture.layers=[1,2,3]", f"output_dir={out}", f"capture.dump_dir={tmp_path / 'shm'}", "data.limit=6"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["ok"] == 6 and manifest["model"]["name"] == "kimi-k2.5"
    check = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(out)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
