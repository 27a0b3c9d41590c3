"""Layers for drafts other than EAGLE-3, chosen from the target's depth once it is read from the checkpoint.

    python -m recipe capture=dflash model=qwen3-8b backend=sglang     # 5 layers, no final state
    python -m recipe capture=dspark ...                               # 5 layers and the final state

DFlash (SGLang's `build_target_layer_ids`, which SpecForge's DFlash trainer shares) takes k layers
whose *outputs* are evenly spaced from layer 1 to layer n-3; a trainer's "output of layer j" is the
residual stream entering layer j+1, ours. DSpark reads its ids from the draft's config
(`dspark_target_layer_ids`, the same "output of" numbering); its preset spreads them as DFlash does
and keeps the final state. Set `capture.layers` (and `capture.spread=0`) for other ids.
"""

from __future__ import annotations

from ..schema import ConfigError


def spread(num_layers: int, k: int) -> list[int]:
    """DFlash's k layers for a target of num_layers, in our numbering (theirs + 1)."""
    if k == 1:
        return [num_layers // 2 + 1]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) + 1 for i in range(k)]


def apply(cfg, num_layers: int) -> None:
    """capture.layers from capture.spread and the checkpoint's depth (the saved config keeps the preset;
    the manifest records the layers)."""
    k = cfg.capture.spread
    if not k:
        return
    if list(cfg.capture.layers):
        raise ConfigError(
            f"capture.spread={k} and capture.layers={list(cfg.capture.layers)}: give one "
            "(capture.spread=0 to keep the layers)"
        )
    layers = spread(num_layers, k)
    if len(set(layers)) < k or num_layers < 4:
        raise ConfigError(f"capture.spread={k} needs a model of at least {k + 3} layers; this one has {num_layers}")
    cfg.capture.layers = layers
