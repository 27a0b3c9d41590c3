"""Exporters to the formats trainers read. Layer-id conventions are mapped explicitly, never silently.

Ours: slot `layer_i` = residual stream entering decoder layer i (= HF output_hidden_states[i]);
`final_post_norm` = last hidden state after the final norm.

specforge (offline EAGLE-3 trainer, `specforge_hidden_states_v1`): one torch file per sample,
  rows_{g}-{g+2000}/data_{idx}.ckpt = {input_ids [1,L], loss_mask [1,L], hidden_state [1,L,H] (final,
  post-norm), aux_hidden_state [1,L,K*H] (captured layers concatenated, ascending)}.
  SpecForge names aux layers "output of layer k" (k = our i - 1): export_info.json records both.
speculators (vLLM extract_hidden_states): one safetensors per sample, hs_{idx}.safetensors =
  {token_ids [L], hidden_states [L, slots, H]}. Its layer ids are ours (input to layer k = HF
  hidden_states[k]), but its last slot is the *pre-norm* last layer; ours is post-norm, so the final
  slot is refused unless --final-norm drop (export captured layers only) or keep-post-norm (stored,
  and export_info.json says it is post-norm).
"""
from __future__ import annotations

import json
from pathlib import Path

from .reader import ShardReader


class ExportError(ValueError):
    pass


def export(fmt: str, src, out, final_norm: str = "refuse") -> int:
    r = ShardReader(src)
    cap = r.manifest["capture"]
    layers, has_final = list(cap["layers"]), bool(cap["final"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"source": str(Path(src).resolve()), "format": fmt, "our_layers_residual_in": layers,
            "our_convention": cap["convention"], "model": r.manifest["model"], "samples": {}}
    if fmt == "specforge":
        import torch

        if not has_final:
            raise ExportError("specforge needs the final hidden state: the shards were captured with capture.final=false")
        info["specforge_aux_layer_ids_output_of"] = [i - 1 for i in layers]
        info["note"] = "SpecForge's eagle_aux_hidden_state_layer_ids count 'output of layer k' = our i - 1"
        K = len(layers)
        for idx, sid in enumerate(r.ids):
            x = r.get(sid)
            h = x["hidden"]  # [L, K+1, H]
            L, _, H = h.shape
            g = idx // 2000 * 2000
            d = out / f"rows_{g}-{g + 2000}"
            d.mkdir(exist_ok=True)
            torch.save({"input_ids": x["input_ids"].long()[None], "loss_mask": x["loss_mask"].long()[None],
                        "hidden_state": h[:, K][None].clone(), "aux_hidden_state": h[:, :K].reshape(L, K * H)[None].clone()},
                       d / f"data_{idx}.ckpt")
            info["samples"][sid] = f"{d.name}/data_{idx}.ckpt"
    elif fmt == "speculators":
        from safetensors.torch import save_file

        if has_final and final_norm == "refuse":
            raise ExportError("speculators/vLLM store the last layer pre-norm; these shards hold the final state "
                              "post-norm. Use --final-norm drop (captured layers only) or keep-post-norm "
                              "(kept, labelled post-norm in export_info.json); nothing was converted silently.")
        keep = len(layers) + (1 if has_final and final_norm == "keep-post-norm" else 0)
        info["hidden_states_slots"] = [f"input_to_layer_{i}" for i in layers] + (
            ["final_post_norm (NOT vLLM's pre-norm last layer)"] if keep > len(layers) else [])
        for idx, sid in enumerate(r.ids):
            x = r.get(sid)
            save_file({"token_ids": x["input_ids"].long().contiguous(), "hidden_states": x["hidden"][:, :keep].contiguous()},
                      str(out / f"hs_{idx}.safetensors"))
            info["samples"][sid] = f"hs_{idx}.safetensors"
    else:
        raise ExportError(f"unknown export format {fmt!r}")
    (out / "export_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return len(r.ids)
