"""backend=sglang refuses, before any GPU work, an architecture the patched SGLang would serve without
dumping, and a checkpoint shape it cannot serve right; the list it accepts is the one the pinned wheel's
own source gives."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, unpack_models

from recipe.capture import architectures, unservable
from recipe.capture.architectures import UnsupportedArchitecture, architecture, refuse_undumped
from recipe.capture.unservable import refuse_unservable

DRAFTS = ("Eagle", "NextN", "MTP", "Assistant")  # SGLang's names for speculative draft heads: never a target
FOREIGN = {"MindSporeForCausalLM"}  # serves MindSpore's own models on Ascend NPUs


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


def defines(classes, name: str, meth: str) -> bool:
    """`name` or one of its bases defines `meth`."""
    c = classes.get(name)
    if c is None:
        return False
    if any(isinstance(f, ast.FunctionDef) and f.name == meth for f in c.body):
        return True
    return any(defines(classes, ast.unparse(b).split(".")[-1], meth) for b in c.bases)


@pytest.fixture(scope="module")
def models(tmp_path_factory, sglang_wheel):
    return unpack_models(sglang_wheel, tmp_path_factory.mktemp("site")) / "sglang/srt/models"


def test_the_accepted_architectures_are_the_pinned_wheels_capturing_classes(models):
    classes, entries = entry_classes(models)
    capture = {e for e in entries if defines(classes, e, "set_eagle3_layers_to_capture")}
    assert len(capture) == 61  # shared/notes/architectures.md: 61 entry classes in 25 files
    assert {e for e in capture - FOREIGN if not any(d in e for d in DRAFTS)} == architectures.DUMPED
    families = {"GptOssForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM", "Glm4MoeForCausalLM",
                "MistralForCausalLM", "MiniMaxM2ForCausalLM", "Llama4ForConditionalGeneration",
                "Qwen3NextForCausalLM"}  # fmt: skip
    assert families <= architectures.DUMPED
    assert {"MixtralForCausalLM", "Gemma2ForCausalLM", "CohereForCausalLM"} <= entries - architectures.DUMPED


def model_dir(folder: Path, config) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_architecture_without_dumps_is_refused_in_one_line_naming_it(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match=r"^MixtralForCausalLM is not dumped .*backend=hf runs any"):
        refuse_undumped(model_dir(tmp_path, {"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture, match="names no architectures"):
        refuse_undumped(model_dir(tmp_path, {"model_type": "llama"}))


def test_a_dumped_but_unproven_architecture_runs_with_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(architectures, "PROVEN", frozenset({"LlamaForCausalLM"}))
    assert refuse_undumped(model_dir(tmp_path, {"architectures": ["LlamaForCausalLM"]})) == "LlamaForCausalLM"
    assert not caplog.records
    assert refuse_undumped(model_dir(tmp_path, {"architectures": ["GptOssForCausalLM"]})) == "GptOssForCausalLM"
    assert "not been compared with HF" in caplog.text


def test_every_proven_class_is_one_the_seam_dumps_and_a_builtin_model_names():
    """PROVEN names what the families scenario compared with HF: its own built-in checkpoints."""
    from recipe.models import BUILTIN, materialize

    assert architectures.PROVEN <= architectures.DUMPED
    built = {architecture(materialize(name)) for name in BUILTIN}
    assert architectures.PROVEN <= built


def run_sglang(cwd: Path, ckpt: Path, out: Path, hidden: int) -> subprocess.CompletedProcess:
    """The user's command with backend=sglang, in a clean environment."""
    return subprocess.run(
        [sys.executable, "-m", "recipe", "backend=sglang", f"model.path={ckpt}", f"output_dir={out}",
         "capture.layers=[1,2]", f"model.hidden_size={hidden}"],
        capture_output=True, text=True, cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_the_recipe_refuses_it_before_tokenizing_or_writing(tmp_path):
    """The user's command, on a checkpoint SGLang would serve without a dump: exit 2, one line, no output."""
    (tmp_path / "ckpt").mkdir()
    ckpt = model_dir(tmp_path / "ckpt", {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 4})
    out = tmp_path / "out"
    r = run_sglang(tmp_path, ckpt, out, hidden=64)
    assert r.returncode != 0
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "MixtralForCausalLM is not dumped by the patched SGLang" in r.stderr + r.stdout
    assert not out.exists()


def qwen3_moe(tmp_path: Path, **keys) -> Path:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_attention_heads": 32,
           "head_dim": 128, "num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 1,
           "mlp_only_layers": [], **keys}  # fmt: skip
    return model_dir(tmp_path, cfg)


def test_a_qwen3_moe_with_dense_layers_is_refused_naming_them(tmp_path):
    """SGLang 0.5.16 builds every Qwen3-MoE layer as MoE: a dense layer's weights would never load (NaN states)."""
    refuse_unservable(qwen3_moe(tmp_path), "Qwen3MoeForCausalLM")  # the published layout: served
    with pytest.raises(UnsupportedArchitecture, match=r"^Qwen3MoeForCausalLM with dense layers \[0\] .*NaN"):
        refuse_unservable(qwen3_moe(tmp_path, mlp_only_layers=[0]), "Qwen3MoeForCausalLM")
    with pytest.raises(UnsupportedArchitecture, match=r"dense layers \[0, 2\]"):
        refuse_unservable(qwen3_moe(tmp_path, decoder_sparse_step=2), "Qwen3MoeForCausalLM")


def test_a_qwen3_moe_head_size_without_sglangs_fused_rope_kernel_is_refused(tmp_path):
    """Head sizes other than 64/128/256/512 take a rotary kernel that asserts on Qwen3-MoE's fused KV write."""
    refuse_unservable(qwen3_moe(tmp_path, head_dim=64), "Qwen3MoeForCausalLM")
    with pytest.raises(UnsupportedArchitecture, match=r"^Qwen3MoeForCausalLM with head_dim 16: .*64, 128, 256, 512"):
        refuse_unservable(qwen3_moe(tmp_path, head_dim=16), "Qwen3MoeForCausalLM")
    refuse_unservable(model_dir(tmp_path, {"head_dim": 16, "num_hidden_layers": 4}), "Qwen3ForCausalLM")


def test_the_allow_list_runs_a_refused_class(tmp_path, monkeypatch):
    """HS_RECIPE_ALLOW_ARCH: a user who knows better (or a scenario checking a fix) runs it regardless."""
    ckpt = qwen3_moe(tmp_path, head_dim=16)
    with pytest.raises(UnsupportedArchitecture):
        refuse_unservable(ckpt, "Qwen3MoeForCausalLM")
    monkeypatch.setenv(unservable.ALLOW_ENV, "LlamaForCausalLM,Qwen3MoeForCausalLM")
    refuse_unservable(ckpt, "Qwen3MoeForCausalLM")


def test_gemma4_is_served_since_its_layers_get_a_copy_of_what_was_captured(tmp_path):
    """Proven on an H100 through the seam with ALIASING_STACKS (docs/gpu.md): no longer refused."""
    for name in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"):
        refuse_unservable(model_dir(tmp_path, {"architectures": [name], "num_hidden_layers": 4}), name)


def test_the_recipe_refuses_an_unservable_shape_before_any_gpu_work(tmp_path):
    """The user's command on the Qwen3-MoE shape SGLang serves as NaN: exit 2, one line, nothing written."""
    (tmp_path / "ckpt").mkdir()
    ckpt = qwen3_moe(tmp_path / "ckpt", mlp_only_layers=[0])
    out = tmp_path / "out"
    r = run_sglang(tmp_path, ckpt, out, hidden=2048)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "Qwen3MoeForCausalLM with dense layers [0]" in r.stderr + r.stdout
    assert not out.exists()
