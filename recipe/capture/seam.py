"""The one seam: where every model SGLang 0.5.16 can capture meets the recipe.

The patch (patches/sglang/v0.5.16) adds two calls to two upstream files and nothing else:
  model_runner.load_model, for the target model only (never a draft worker's), when
  SGLANG_HS_DUMP_DIR is set:                      install(self.model)
  LogitsProcessor.forward, first thing:           self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)
                                                  (hs_dump is None on every processor but one)

Every model hands its logits processor the same three things on an EXTEND pass: the ForwardBatch,
the post-norm final state [T, H] and its aux captures as a list of K [T, H] in ascending layer order
(seen on an H200 for ten classes, shared/notes/architectures.md). So the hook (sglang_hook.DumpHook)
sits there, and `install` does the two things that differ by model, through the model's own code:
1. Capture on, with exactly the configured ids. The class's own `set_eagle3_layers_to_capture`
   switches capture on wherever that class keeps it (a wrapper hands it to its language model), but
   shifts the ids: +1 in most classes, in DeepSeek only when the first id is 1. So install calls it,
   sees which modules it changed (a `layers_to_capture` list, or the `_is_layer_to_capture` flags
   of a module's layers) and writes the exact ids there.
2. The target's processor: the one owned by the module whose capture the call switched on. A
   wrapper's own processor that is never called (Llama-4's) gets no hook.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

from .settings import ENV_LAYERS, HookSettings
from .sglang_hook import DumpHook

log = logging.getLogger("recipe.sglang_hook")

CAPTURE_FLAG = "capture_aux_hidden_states"  # on the module whose forward returns (final, aux)
ID_LIST = "layers_to_capture"  # on the decoder stack: entering these layers is captured
LAYER_FLAG = "_is_layer_to_capture"  # or flags on the layers themselves (Qwen2-MoE, Qwen3-Next, ...)
# Decoder stacks whose forward reads only the layers' flags. Qwen3.5's wrappers inherit Qwen3-VL's switch,
# which writes the id list alone: no layer would be captured and the wrapper's forward fails to unpack
# (seen on an H100). tests/test_seam.py derives the set from the pinned wheel's forwards.
FLAG_STACKS = frozenset({"MiniMaxM3Model", "Qwen2MoeModel", "Qwen3NextModel", "Qwen3_5ForCausalLM"})
# Decoder stacks that capture the live tensor a layer then writes into: Gemma-4's layer keeps its input as
# the residual, and its fused add-RMSNorm adds the attention output into it in place (read in the wheel;
# it explains slots 0.4-0.8 rel-L2 from HF, each nearest the next index, seen on an H100). Their captured
# layers get a copy of their input to work on.
ALIASING_STACKS = frozenset({"Gemma4TextModel"})


class SeamError(RuntimeError):
    """The model does not capture in a way the seam can set exactly: the server refuses to start."""


def sglang_pp_size() -> int:
    from sglang.srt.distributed import get_pp_group

    return get_pp_group().world_size


def install(model, env=os.environ, pp_size=sglang_pp_size):
    """Called once the target model is loaded: exact capture on, the hook on its processor.
    Returns the hook (None when the dump is off: upstream SGLang, unchanged)."""
    s = HookSettings.from_env(env)
    if s is None:
        return None
    if pp_size() > 1:
        raise SeamError("hidden-state dump does not support pipeline parallelism (pp_size > 1)")
    layers = list(s.layers)
    if layers != sorted(set(layers)) or (layers and layers[0] < 1):
        raise ValueError(f"{ENV_LAYERS}={layers}: need ascending ids >= 1 (SGLang cannot capture layer 0)")
    owners = capture_exactly(model, layers)
    processor = target_processor(model, owners)
    hook = DumpHook(s)
    processor.hs_dump = hook
    log.info("hidden-state dump on %s: layers %s (+final: %s) -> %s", type(model).__name__, layers, hook.final,
             s.dump_dir)  # fmt: skip
    return hook


def capture_exactly(model, layers: list[int]) -> list:
    """Capture on through the model's own switch, then exactly `layers` wherever the switch put its
    ids. Returns the modules whose capture flag it turned on. With no layers (the final state alone)
    the switch only shows where capture lives, and is turned off again."""
    before = {name: state(m) for name, m in model.named_modules()}
    model.set_eagle3_layers_to_capture([i - 1 for i in layers] or [0])  # theirs: "output of layer k"
    touched = [m for name, m in model.named_modules() if state(m) != before.get(name)]
    owners = [m for m in touched if getattr(m, CAPTURE_FLAG, None) is True]
    holders = [m for m in touched if state(m)[1] != ((), ())]
    if not owners or not holders:
        raise SeamError(
            f"{type(model).__name__}.set_eagle3_layers_to_capture switched on no capture the dump can set "
            f"(capture flag on {len(owners)} modules, layer ids on {len(holders)})"
        )
    for m in holders:
        set_ids(m, layers)
        keep_captured(m, layers)
    if not layers:
        for m in owners:
            setattr(m, CAPTURE_FLAG, False)
    return owners


def state(m) -> tuple:
    """(capture flag, (ids in its list, ids its layers flag)) of one module."""
    listed = tuple(getattr(m, ID_LIST, None) or ())
    flagged = tuple(i for i, layer in enumerate(decoder_layers(m)) if getattr(layer, LAYER_FLAG, False))
    return getattr(m, CAPTURE_FLAG, None), (listed, flagged)


def decoder_layers(m) -> list:
    layers = getattr(m, "layers", None)
    try:
        return list(layers) if layers is not None else []
    except TypeError:  # `layers` that is not a module list
        return []


def set_ids(m, layers: list[int]) -> None:
    if hasattr(m, ID_LIST):
        setattr(m, ID_LIST, list(layers))
    stack = decoder_layers(m)
    reads_flags = any(c.__name__ in FLAG_STACKS for c in type(m).__mro__)
    if reads_flags or any(hasattr(layer, LAYER_FLAG) for layer in stack):
        for i, layer in enumerate(stack):
            setattr(layer, LAYER_FLAG, i in layers)


def keep_captured(m, layers: list[int]) -> None:
    """In an aliasing stack, each captured layer works on a copy of its input: the captured tensor stays
    the residual stream entering it."""
    if any(c.__name__ in ALIASING_STACKS for c in type(m).__mro__):
        stack = decoder_layers(m)
        for i in layers:
            if i < len(stack):  # the signature read once here, not on every forward pass
                hook = functools.partial(copy_hidden_states, inspect.signature(stack[i].forward))
                stack[i].register_forward_pre_hook(hook, with_kwargs=True)


def copy_hidden_states(signature, layer, args: tuple, kwargs: dict):
    """A forward pre-hook: the layer's `hidden_states` argument replaced by a copy, however it is passed."""
    bound = signature.bind(*args, **kwargs)
    bound.arguments["hidden_states"] = bound.arguments["hidden_states"].clone()
    return bound.args, bound.kwargs


def target_processor(model, owners: list):
    """The logits processor the target's forward calls: owned by the module whose capture is on.
    Exactly one, or the server refuses to start (never a guess between two)."""
    procs = [m.logits_processor for m in owners if hasattr(m, "logits_processor")]
    if not procs:  # capture switched on in a module below the one that owns the processor
        procs = [m.logits_processor for _, m in model.named_modules() if hasattr(m, "logits_processor")]
    unique = list({id(p): p for p in procs}.values())
    if len(unique) != 1:
        raise SeamError(f"{type(model).__name__}: {len(unique)} candidate logits processors for the dump, need one")
    return unique[0]
