"""INT4 routed experts the way Kimi-K2.5 ships them: compressed-tensors `pack-quantized`.

The scheme (Kimi-K2-Thinking's published `quantization_config`; Kimi-K2.5 carries the same block
under `text_config`, where SGLang 0.5.16's `configs/kimi_k25.py` reads it): every `Linear` is INT4,
symmetric, one scale per group of 32 inputs, except what `ignore` names, which leaves only the
routed experts (`mlp.experts.<e>.{gate,up,down}_proj`). Each quantized weight `[out, in]` is stored
as three tensors: `weight_packed` int32 `[out, in/8]` (eight 4-bit values per word, lowest nibble
first, each value + 8), `weight_scale` bf16 `[out, in/32]` and `weight_shape` `[2]`.

`quantize` packs with the compressed-tensors package itself (the builder of the tiny INT4 Kimi);
`dequantize` is ours (a few lines, no dependency) and is what the HF backend reads such a
checkpoint with: the bf16 weights the INT4 ones stand for, so HF is the reference for the model
SGLang computes. A test holds the two against compressed-tensors' own decompression, bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ModelDirError

GROUP = 32
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": GROUP,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
PACKED = ("weight_packed", "weight_scale", "weight_shape")


def quantize(tensors: dict) -> dict:
    """A checkpoint's tensors with each routed expert's bf16 `weight` replaced by the packed triple,
    through compressed-tensors' own quantizer and packer (min-max scales per group of 32)."""
    try:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.utils.helpers import calculate_qparams
    except ImportError as e:
        raise ModelDirError(
            f"the INT4 built-in model is packed by compressed-tensors ({e}): pip install compressed-tensors==0.20.1"
        ) from None

    args = QuantizationArgs(**QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = {}
    for name, w in tensors.items():
        if not ROUTED_EXPERT.search(name):
            out[name] = w
            continue
        groups = w.float().view(w.shape[0], -1, GROUP)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        packed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}, scheme
        )
        base = name.removesuffix("weight")
        out.update({base + k: packed[k].contiguous() for k in PACKED})
    assert any(k.endswith("weight_packed") for k in out), "no routed expert to quantize"
    return out


def dequantize(packed, scale, shape):
    """weight_packed int32 [out, in/8] + weight_scale [out, in/G] -> the bf16 weight [out, in]."""
    import torch

    rows, cols = int(shape[0]), int(shape[1])
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian words: element 2k is byte k's low nibble
    q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1)[:, :cols].to(torch.float32) - 8
    w = q.view(rows, -1, cols // scale.shape[1]) * scale.float().unsqueeze(-1)
    return w.view(rows, cols).to(scale.dtype)


def quantization_of(text_config: dict) -> dict | None:
    """The checkpoint's quantization block if the HF backend can read it, None if it has none."""
    q = text_config.get("quantization_config")
    if not q:
        return None
    weights = [g.get("weights") or {} for g in q.get("config_groups", {}).values()]
    ok = (
        q.get("quant_method") == "compressed-tensors"
        and q.get("format") == "pack-quantized"
        and all(w.get("num_bits") == 4 and w.get("symmetric") and w.get("strategy") == "group" for w in weights)
    )
    if not ok:
        raise ModelDirError(
            f"the HF backend reads INT4 pack-quantized (symmetric, grouped) compressed-tensors weights only, "
            f"not {q.get('quant_method')}/{q.get('format')}: use backend=sglang for this checkpoint"
        )
    return q


def write_dequantized(model_dir: Path, dest: Path) -> None:
    """Every safetensors file of model_dir as one bf16 `model.safetensors` in dest, each packed triple
    turned back into its `weight`. Memory: the whole bf16 model (the HF backend holds it anyway)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            bases = {n.removesuffix("weight_packed") for n in st.keys() if n.endswith(".weight_packed")}
            for name in st.keys():
                base, _, leaf = name.rpartition(".")
                if base + "." not in bases:
                    out[name] = st.get_tensor(name)
                elif leaf == "weight_packed":
                    out[base + ".weight"] = dequantize(*(st.get_tensor(f"{base}.{k}") for k in PACKED))
    save_file(out, Path(dest) / "model.safetensors", metadata={"format": "pt"})
