"""The patches apply exactly to the pinned upstream SGLang (downloaded from PyPI once, cached)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SGLANG_VERSION, unpack_models

from recipe import patch

VERSION = SGLANG_VERSION
PATCHED = [
    "sglang/srt/models/llama.py",
    "sglang/srt/models/deepseek_v2.py",
    "sglang/srt/models/qwen3.py",
    "sglang/srt/models/qwen3_moe.py",
]


@pytest.fixture
def site(tmp_path, sglang_wheel):
    return unpack_models(sglang_wheel, tmp_path)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "recipe.patch", *args], capture_output=True, text=True, cwd=ROOT)


def test_check_apply_status(site):
    r = cli("check", "--site-packages", str(site))
    assert r.returncode == 0, r.stderr
    assert not json.loads(r.stdout)["already_applied"]
    r = cli("apply", "--site-packages", str(site))
    assert r.returncode == 0, r.stderr
    st = json.loads(cli("status", "--site-packages", str(site)).stdout)
    assert st["applied"] and st["intact"] and st["sglang_version"] == VERSION
    assert sorted(st["files"]) == sorted(PATCHED)
    assert len(st["patch_set_sha256"]) == 64
    for rel in PATCHED:  # byte-compiled (apply compiles) and the hook is wired in
        assert list((site / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"))
        src = (site / rel).read_text()
        assert src.count("self.hs_dump(forward_batch, hidden_states, aux_hidden_states)") == 1
    # applying again is a no-op, and status notices a later edit
    assert cli("apply", "--site-packages", str(site)).returncode == 0
    with open(site / PATCHED[0], "a") as f:
        f.write("# edited\n")
    r = cli("status", "--site-packages", str(site))
    assert r.returncode == 1 and PATCHED[0] in r.stdout


def test_hook_call_sits_in_forward_after_the_unpacking(site):
    patch.apply(site, VERSION)
    tree = ast.parse((site / "sglang/srt/models/llama.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLM")
    fwd = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    src = ast.unparse(fwd)
    assert src.index("hidden_states, aux_hidden_states = hidden_states") < src.index("self.hs_dump(forward_batch")
    assert src.index("self.hs_dump(forward_batch") < src.index("self.logits_processor(")
    init = ast.unparse(next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"))
    assert "self.hs_dump = install(self)" in init and "set_eagle3_layers_to_capture" not in init


def test_a_subclass_that_skips_the_patched_init_still_runs_the_patched_forward(site):
    """SGLang's EAGLE-3 draft (LlamaForCausalLMEagle3) subclasses LlamaForCausalLM with an __init__
    of its own and inherits its forward: a draft served beside a patched target must not need
    hs_dump (it crashed the first speculative-decoding server: AttributeError 'hs_dump')."""
    draft = ast.parse((site / "sglang/srt/models/llama_eagle3.py").read_text())
    cls = next(n for n in draft.body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3")
    assert [ast.unparse(b) for b in cls.bases] == ["LlamaForCausalLM"]
    own = {n.name: ast.unparse(n) for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "super().__init__" not in own["__init__"] and "forward" not in own
    patch.apply(site, VERSION)
    for rel in PATCHED:
        tree = ast.parse((site / rel).read_text())
        for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            fwd = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
            if fwd is not None and "hs_dump" in ast.unparse(fwd):
                reads = [
                    a
                    for a in ast.walk(fwd)
                    if isinstance(a, ast.Attribute) and a.attr == "hs_dump" and isinstance(a.ctx, ast.Load)
                ]
                guard = "getattr(self, 'hs_dump', None) is not None"
                assert guard in ast.unparse(fwd), (rel, c.name)
                assert len(reads) == 1  # the call itself, under the guard


def test_a_drifted_upstream_fails_loudly_and_writes_nothing(site):
    target = site / "sglang/srt/models/deepseek_v2.py"
    lines = target.read_text().splitlines(keepends=True)
    lines.insert(100, "# upstream moved things\n")
    target.write_text("".join(lines))
    before = {rel: (site / rel).read_bytes() for rel in PATCHED}
    r = cli("check", "--site-packages", str(site))
    assert r.returncode == 1 and "PATCH FAILED" in r.stderr and "deepseek_v2" in r.stderr
    r = cli("apply", "--site-packages", str(site))
    assert r.returncode == 1
    assert {rel: (site / rel).read_bytes() for rel in PATCHED} == before  # all or nothing
    assert not (site / "sglang" / patch.STATUS_FILE).exists()


def test_patches_stay_tiny():
    for pf in sorted((ROOT / "patches/sglang" / f"v{VERSION}").glob("*.patch")):
        changed = [
            line for line in pf.read_text().splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        assert len(changed) <= 12, (pf.name, len(changed))


def test_unknown_version_is_a_clear_error(site):
    r = cli("check", "--site-packages", str(site), "--version", "0.4.0")
    assert r.returncode == 1 and "no patches for SGLang 0.4.0" in r.stderr
