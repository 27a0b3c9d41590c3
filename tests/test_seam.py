"""The one seam (recipe/capture/seam.py) against every model class of the pinned SGLang that can capture.

Each class's own `set_eagle3_layers_to_capture`, taken from the pinned wheel's source, runs on a stand-in
of that class's module tree (built from its `__init__`: where the decoder stack, the language model and
the logits processors sit). The seam must leave exactly the configured ids wherever the class keeps
them, and put the hook on exactly the processor the class's forward calls."""

import ast
import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import NEWEST, SGLANG_VERSION, unpack_models, wheel

from recipe.capture import seam
from recipe.capture.settings import HookSettings

DRAFTS = ("Eagle", "NextN", "MTP", "Assistant")  # SGLang's draft heads: never a target
FOREIGN = {"MindSporeForCausalLM"}  # serves MindSpore's own models (Ascend NPUs), built at run time
DEPTH = 8


@pytest.fixture(scope="module", params=[SGLANG_VERSION, NEWEST])
def source(request, tmp_path_factory):
    """class name -> its ClassDef, over every model file of the pinned wheel (and of the newest release,
    whose seam patch is checked here too); and the entry classes."""
    models = unpack_models(wheel(request.param), tmp_path_factory.mktemp("site")) / "sglang/srt/models"
    classes, entries, served, by_module = {}, set(), {}, {}
    for f in sorted(models.glob("*.py")):
        own = {}
        for n in ast.parse(f.read_text(encoding="utf-8-sig")).body:
            if isinstance(n, ast.ClassDef):
                own[n.name] = by_module[(f.stem, n.name)] = n
                classes.setdefault(n.name, n)
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in n.targets):
                names = n.value.elts if isinstance(n.value, (ast.List, ast.Tuple)) else [n.value]
                entries |= {e.id for e in names if isinstance(e, ast.Name)}
                served.update({e.id: own[e.id] for e in names if isinstance(e, ast.Name) and e.id in own})
    classes.update(served)  # two files may define one name (0.5.23's Qwen3_5ForCausalLM): the entry's wins
    return SimpleNamespace(classes=classes, entries=entries, by_module=by_module, version=request.param)


def resolve(src, ref: str | None) -> ast.ClassDef | None:
    """A class by its name, or by `module.Name` where two files define one name."""
    if not ref:
        return None
    module, _, name = ref.rpartition(".")
    return src.by_module.get((module.rpartition(".")[2], name)) if module else src.classes.get(name)


def find(src, cls: str, meth: str) -> ast.FunctionDef | None:
    """`meth` as `cls` runs it: its own, or the nearest base's."""
    c = resolve(src, cls)
    if c is None:
        return None
    own = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == meth), None)
    if own is not None:
        return own
    return next((m for b in c.bases if (m := find(src, ast.unparse(b), meth))), None)


def init_text(src, cls: str) -> str:
    """The `__init__` code that runs for `cls` (its bases' where it calls super().__init__), and its
    class-level assignments (`body_cls = qwen3_5.Qwen3_5ForCausalLM`)."""
    c, text = resolve(src, cls), ""
    while c is not None:
        text += "".join(ast.unparse(a) + "\n" for a in c.body if isinstance(a, ast.Assign))
        init = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        text += ast.unparse(init) + "\n" if init is not None else ""
        if init is not None and "super().__init__" not in text:
            break
        c = resolve(src, ast.unparse(c.bases[0])) if c.bases else None
    return text


def compiled(fn: ast.FunctionDef):
    """The upstream method as a function (annotations left unevaluated; PP: one stage, the last)."""
    code = "from __future__ import annotations\n" + textwrap.dedent(ast.unparse(fn))
    stage = SimpleNamespace(is_last_rank=True, world_size=1)
    scope = {"get_pp_group": lambda: stage, "get_parallel": lambda: SimpleNamespace(pp_group=stage)}
    exec(compile(code, f"<sglang {fn.name}>", "exec"), scope)
    return scope[fn.name]


class Processor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hs_dump = None


def built_class(name: str, fn) -> type:
    return type(name, (torch.nn.Module,), {"set_eagle3_layers_to_capture": fn} if fn else {})


def decoder(src, cls: str | None, switch: bool) -> torch.nn.Module:
    """The decoder stack, named as its class (the seam reads the name); its own switch where called."""
    own = find(src, cls, "set_eagle3_layers_to_capture") if switch else None  # Qwen2-MoE's stack has its own
    m = built_class(cls or "Decoder", compiled(own) if own else None)()
    m.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(DEPTH))
    m.layers_to_capture = []
    return m


def assigned(init: str, attr: str) -> str | None:
    """The class built into `self.<attr>` by an __init__ (None: not built there); `self.<x>(...)`
    through a class-level `x = Class`."""
    tree = ast.parse(init)
    aliases = {ast.unparse(a.targets[0]): ast.unparse(a.value) for a in tree.body if isinstance(a, ast.Assign)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == f"self.{attr}" for t in node.targets):
            if isinstance(node.value, ast.Call):
                callee = ast.unparse(node.value.func)
                return aliases.get(callee.removeprefix("self."), callee)
    return None


def stand_in(src, cls: str) -> torch.nn.Module:
    """`cls`'s module tree as far as capture goes, with its own set_eagle3_layers_to_capture."""
    fn = find(src, cls, "set_eagle3_layers_to_capture")
    body, init = ast.unparse(fn), init_text(src, cls)
    m = built_class(cls, compiled(fn))()
    m.pp_group = SimpleNamespace(is_last_rank=True, world_size=1)
    m.config = SimpleNamespace(num_hidden_layers=DEPTH, text_config=SimpleNamespace(num_hidden_layers=DEPTH))
    if "self.language_model.set_eagle3_layers_to_capture" in body:
        m.language_model = stand_in(src, assigned(init, "language_model"))
    elif "self.language_model.layers_to_capture" in body:
        m.language_model = decoder(src, assigned(init, "language_model"), False)
    else:
        m.model = decoder(src, assigned(init, "model"), "self.model.set_eagle3_layers_to_capture" in body)
    if "self.logits_processor =" in init or "self.logits_processor=" in init:
        m.logits_processor = Processor()
    return m


def targets(src) -> list[str]:
    return sorted(
        e
        for e in src.entries - FOREIGN
        if find(src, e, "set_eagle3_layers_to_capture") and not any(d in e for d in DRAFTS)
    )


def env(tmp_path, layers) -> dict:
    return HookSettings(str(tmp_path), tuple(layers), True, "hsx-", 1 << 20).to_env()


def ids(m) -> list[tuple[str, list[int]]]:
    """Where the model keeps capture ids, and which: each list, and each stack's flagged layers."""
    out = []
    for name, sub in m.named_modules():
        if getattr(sub, seam.ID_LIST, None):
            out.append((name, list(sub.layers_to_capture)))
        flagged = [i for i, layer in enumerate(seam.decoder_layers(sub)) if getattr(layer, seam.LAYER_FLAG, False)]
        if flagged:
            out.append((name + ".layers", flagged))
    return out


def reads_only_flags(src, cls: str) -> bool:
    """The stack's forward captures where its layers are flagged, and reads no id list."""
    fn = find(src, cls, "forward")
    body = ast.unparse(fn).replace(seam.LAYER_FLAG, "") if fn else ""
    return fn is not None and body != ast.unparse(fn) and "layers_to_capture" not in body


def hooked(m) -> list[str]:
    return [name for name, sub in m.named_modules() if isinstance(sub, Processor) and sub.hs_dump is not None]


@pytest.mark.parametrize("layers", [[1, 4, 6], [2, 4, 6], [3, 5, 7]])  # DeepSeek shifts only when ids[0]-1 == 1
def test_every_capturing_class_gets_exactly_the_configured_ids_and_one_hooked_processor(source, tmp_path, layers):
    names = targets(source)
    assert len(names) == 45 if source.version == SGLANG_VERSION else len(names) >= 45  # 0.5.23: 54
    assert {"GptOssForCausalLM", "Llama4ForConditionalGeneration", "Qwen3NextForCausalLM"} <= set(names)
    for cls in names:
        m = stand_in(source, cls)
        if not any(isinstance(sub, Processor) for sub in m.modules()):  # an embedding model (0.5.23's
            with pytest.raises(seam.SeamError, match="0 candidate logits processors"):  # EmbeddingGemma)
                seam.install(m, env(tmp_path, layers), pp_size=lambda: 1)
            continue
        hook = seam.install(m, env(tmp_path, layers), pp_size=lambda: 1)
        where = ids(m)
        assert where and all(v == layers for _, v in where), (cls, where)
        for name, sub in m.named_modules():  # what the stack's forward reads holds the ids (Qwen3.5's flags)
            if reads_only_flags(source, type(sub).__name__):
                assert (name + ".layers" if name else "layers", layers) in where, (cls, name, where)
        assert len(hooked(m)) == 1, (cls, hooked(m))
        owner = m.get_submodule(hooked(m)[0].rsplit(".", 1)[0]) if "." in hooked(m)[0] else m
        assert getattr(owner, seam.CAPTURE_FLAG, None) is True or cls.endswith("ConditionalGeneration"), cls
        hook.close()


def test_the_stacks_that_read_only_flags_are_the_pinned_wheels(source):
    """The seam's table of stacks whose forward reads only their layers' flags is the pinned wheel's."""
    if source.version != SGLANG_VERSION:
        pytest.skip("the seam's table is the pinned wheel's")
    own = {n for n, c in source.classes.items() if any(getattr(f, "name", "") == "forward" for f in c.body)}
    assert seam.FLAG_STACKS == {n for n in own if reads_only_flags(source, n)}


class AddsIntoItsInput(torch.nn.Module):
    """A layer as SGLang 0.5.16's Gemma-4 one: its input kept as the residual, a sum written into it in place."""

    def forward(self, positions, hidden_states, per_layer_input, forward_batch, **kwargs):
        hidden_states.add_(1.0)
        return hidden_states, None


def test_a_stack_whose_layers_write_into_their_input_keeps_what_it_captured(source, tmp_path):
    """Gemma-4's stack captures the live tensor its next layer adds into: each captured layer gets a copy,
    so a slot holds the residual stream entering its layer, not a later state."""
    assert seam.ALIASING_STACKS <= set(source.classes)
    m = stand_in(source, "Gemma4ForConditionalGeneration")
    stack = m.language_model
    assert type(stack).__name__ == "Gemma4TextModel"
    stack.layers = torch.nn.ModuleList(AddsIntoItsInput() for _ in range(DEPTH))
    hook = seam.install(m, env(tmp_path, [1, 3]), pp_size=lambda: 1)
    h, aux = torch.zeros(2, 4), []
    for i, layer in enumerate(stack.layers):  # the stack's own loop (gemma4_causal.py)
        if i in stack.layers_to_capture:
            aux.append(h)
        h = layer(positions=None, hidden_states=h, per_layer_input=None, forward_batch=None)[0]
    assert [float(a[0, 0]) for a in aux] == [1.0, 3.0]  # entering layers 1 and 3
    assert float(h[0, 0]) == DEPTH
    hook.close()


def test_a_wrappers_idle_processor_gets_no_hook(source, tmp_path):
    """Llama-4's wrapper owns a processor that is never called; its language model's is."""
    m = stand_in(source, "Llama4ForConditionalGeneration")
    assert isinstance(m.logits_processor, Processor) and isinstance(m.language_model.logits_processor, Processor)
    seam.install(m, env(tmp_path, [1, 2, 3]), pp_size=lambda: 1).close()
    assert hooked(m) == ["language_model.logits_processor"]


def test_the_final_state_alone_leaves_capture_off(source, tmp_path):
    for cls in ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "KimiK25ForConditionalGeneration"):
        m = stand_in(source, cls)
        seam.install(m, env(tmp_path, []), pp_size=lambda: 1).close()
        flags = [n for n, sub in m.named_modules() if getattr(sub, seam.CAPTURE_FLAG, None)]
        assert flags == [] and ids(m) == [] and len(hooked(m)) == 1, (cls, flags, ids(m))


def test_off_without_the_dump_dir_and_refusals(source, tmp_path):
    m = stand_in(source, "LlamaForCausalLM")
    assert seam.install(m, {}, pp_size=lambda: 1) is None and hooked(m) == [] and ids(m) == []
    with pytest.raises(seam.SeamError, match="pipeline parallelism"):
        seam.install(m, env(tmp_path, [1, 2]), pp_size=lambda: 2)
    with pytest.raises(ValueError, match="layer 0"):
        seam.install(m, env(tmp_path, [0, 2]), pp_size=lambda: 1)
    silent = built_class("Silent", lambda self, ids: None)()
    silent.model, silent.logits_processor = decoder(source, None, False), Processor()
    with pytest.raises(seam.SeamError, match="Silent.set_eagle3_layers_to_capture switched on no capture"):
        seam.install(silent, env(tmp_path, [1, 2]), pp_size=lambda: 1)
