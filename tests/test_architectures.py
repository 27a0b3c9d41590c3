"""backend=sglang refuses, before any GPU work, an architecture the patched SGLang would serve without
dumping; the list it accepts is the one the pinned wheel's own source gives."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SGLANG_VERSION, unpack_models

from recipe import patch
from recipe.capture import architectures
from recipe.capture.architectures import UnsupportedArchitecture, refuse_undumped

DRAFTS = ("Eagle", "NextN", "MTP")  # SGLang's names for speculative draft heads: never a target


def entry_classes(models: Path) -> tuple[dict[str, ast.ClassDef], set[str]]:
    classes, entries = {}, set()
    for f in sorted(models.glob("*.py")):
        for n in ast.parse(f.read_text(encoding="utf-8-sig")).body:
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, n)
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in n.targets):
                v = n.value
                names = v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]
                entries |= {e.id for e in names if isinstance(e, ast.Name)}
    return classes, entries


def method(c: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name), None)


def runs_patched(classes, name: str, meth: str) -> bool:
    """Up the single-base chain from `name`, the `meth` that runs is a patched one (an `__init__`
    that calls super().__init__ passes on to its base)."""
    while name in classes:
        c = classes[name]
        own = method(c, meth)
        if own is not None and "hs_dump" in ast.unparse(own):
            return True
        if own is not None and not (meth == "__init__" and "super().__init__" in ast.unparse(own)):
            return False
        bases = [ast.unparse(b) for b in c.bases]
        if len(bases) != 1:
            return False
        name = bases[0]
    return False


@pytest.fixture(scope="module")
def models(tmp_path_factory, sglang_wheel):
    site = unpack_models(sglang_wheel, tmp_path_factory.mktemp("site"))
    patch.apply(site, SGLANG_VERSION)
    return site / "sglang/srt/models"


def test_the_accepted_architectures_are_the_ones_the_patched_wheel_dumps(models):
    classes, entries = entry_classes(models)
    targets = {e for e in entries if not any(d in e for d in DRAFTS)}
    dumped = {e for e in targets if runs_patched(classes, e, "__init__") and runs_patched(classes, e, "forward")}
    assert dumped == architectures.DUMPED
    assert {"GptOssForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM", "Glm4MoeForCausalLM"} <= entries - dumped
    for wrapper, inner in architectures.WRAPPERS.items():  # an entry class that builds a dumped one
        assert wrapper in entries and inner in architectures.DUMPED
        assert inner in ast.unparse(classes[wrapper])


def model_dir(folder: Path, config) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_architecture_without_dumps_is_refused_in_one_line_naming_it(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match=r"^GptOssForCausalLM is not dumped .*backend=hf runs any"):
        refuse_undumped(model_dir(tmp_path, {"architectures": ["GptOssForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture, match="names no architectures"):
        refuse_undumped(model_dir(tmp_path, {"model_type": "llama"}))


def test_a_dumped_but_unproven_architecture_runs_with_a_warning(tmp_path, caplog):
    assert refuse_undumped(model_dir(tmp_path, {"architectures": ["LlamaForCausalLM"]})) == "LlamaForCausalLM"
    assert not caplog.records
    assert refuse_undumped(model_dir(tmp_path, {"architectures": ["Qwen3ForCausalLM"]})) == "Qwen3ForCausalLM"
    assert "not been compared with HF" in caplog.text
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"]}
    assert refuse_undumped(model_dir(tmp_path, kimi)) == "KimiK25ForConditionalGeneration"


def test_the_recipe_refuses_it_before_tokenizing_or_writing(tmp_path):
    """The user's command, on a checkpoint SGLang would serve without a dump: exit 2, one line, no output."""
    (tmp_path / "ckpt").mkdir()
    ckpt = model_dir(tmp_path / "ckpt", {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4})
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "recipe", "backend=sglang", f"model.path={ckpt}", f"output_dir={out}",
         "capture.layers=[1,2]", "model.hidden_size=64"],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode != 0
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "Gemma3ForCausalLM is not dumped by the patched SGLang" in r.stderr + r.stdout
    assert not out.exists()
