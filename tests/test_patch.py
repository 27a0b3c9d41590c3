"""The patches apply exactly to the pinned upstream SGLang (downloaded from PyPI once, cached)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NEWEST, ROOT, SGLANG_VERSION, unpack_models, wheel

from recipe import patch

VERSION = SGLANG_VERSION
PATCHED = ["sglang/srt/layers/logits_processor.py", "sglang/srt/model_executor/model_runner.py"]


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
        assert (site / rel).read_text().count(patch.HOOKS[rel]) == 1
    # applying again is a no-op, and status notices a later edit
    assert cli("apply", "--site-packages", str(site)).returncode == 0
    with open(site / PATCHED[0], "a") as f:
        f.write("# edited\n")
    r = cli("status", "--site-packages", str(site))
    assert r.returncode == 1 and PATCHED[0] in r.stdout


def function(tree, cls: str, name: str) -> ast.FunctionDef:
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name)


def hook_runs_first(site) -> None:
    tree = ast.parse((site / PATCHED[0]).read_text())
    fwd = function(tree, "LogitsProcessor", "forward")
    first = ast.unparse(fwd.body[0])
    assert first == ("if self.hs_dump is not None:\n"
                     "    self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)")  # fmt: skip
    assert [a.arg for a in fwd.args.args][:6] == [
        "self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"]  # fmt: skip
    init = ast.unparse(function(tree, "LogitsProcessor", "__init__"))
    assert init.rstrip().endswith("self.hs_dump = None")


def installed_once_loaded(site) -> None:
    load = function(ast.parse((site / PATCHED[1]).read_text()), "ModelRunner", "load_model")
    src = ast.unparse(load)
    assert src.index("self.model = loaded.model") < src.index("install(self.model)")
    guard = next(n for n in ast.walk(load) if isinstance(n, ast.If) and "install(self.model)" in ast.unparse(n)
                 and ast.unparse(n.test) == "not self.is_draft_worker")  # fmt: skip
    inner = next(n for n in guard.body if isinstance(n, ast.If))
    assert ast.unparse(inner.test) == "os.environ.get('SGLANG_HS_DUMP_DIR')"
    assert "from recipe.capture.seam import install" in ast.unparse(inner)


def test_the_hook_runs_first_in_every_logits_processor_and_only_where_the_seam_set_it(site):
    """Every model's forward ends in LogitsProcessor.forward with the whole pass in hand: the hook is its
    first statement, before any row is pruned; every processor starts without one (a draft's too)."""
    patch.apply(site, VERSION)
    hook_runs_first(site)


def test_the_seam_is_installed_once_the_target_model_is_loaded_never_in_a_draft_worker(site):
    patch.apply(site, VERSION)
    installed_once_loaded(site)


def test_the_newest_sglang_takes_the_same_seam(tmp_path):
    """The seam as a patch set for the newest release (patches/sglang/v0.5.23): it applies exactly to that
    wheel, in the same two places with the same signature. Not run on a GPU: the GPU host's torch (2.11)
    is older than what 0.5.19 and later require (2.13-2.14.1)."""
    site = unpack_models(wheel(NEWEST), tmp_path)
    r = cli("apply", "--site-packages", str(site))  # the version read from the wheel's dist-info
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sglang_version"] == NEWEST
    hook_runs_first(site)
    installed_once_loaded(site)
    assert patch.smoke(site)["files"] == sorted(PATCHED)


def test_smoke_names_a_missing_call(site):
    patch.apply(site, VERSION)
    assert patch.smoke(site)["files"] == sorted(PATCHED)
    st = json.loads((site / "sglang" / patch.STATUS_FILE).read_text())
    text = (site / PATCHED[0]).read_text().replace(patch.HOOKS[PATCHED[0]], "pass")
    (site / PATCHED[0]).write_text(text)
    st["files"][PATCHED[0]] = patch.sha256(text.encode())  # as if the file had been patched this way
    (site / "sglang" / patch.STATUS_FILE).write_text(json.dumps(st))
    with pytest.raises(patch.PatchError, match="logits_processor.py: hook not wired in exactly once"):
        patch.smoke(site)


def test_a_drifted_upstream_fails_loudly_and_writes_nothing(site):
    target = site / PATCHED[0]
    lines = target.read_text().splitlines(keepends=True)
    lines.insert(100, "# upstream moved things\n")
    target.write_text("".join(lines))
    before = {rel: (site / rel).read_bytes() for rel in PATCHED}
    r = cli("check", "--site-packages", str(site))
    assert r.returncode == 1 and "PATCH FAILED" in r.stderr and "logits_processor" in r.stderr
    r = cli("apply", "--site-packages", str(site))
    assert r.returncode == 1
    assert {rel: (site / rel).read_bytes() for rel in PATCHED} == before  # all or nothing
    assert not (site / "sglang" / patch.STATUS_FILE).exists()


@pytest.mark.parametrize("version", [VERSION, NEWEST])
def test_patches_stay_tiny_and_touch_two_upstream_files(version):
    files = sorted((ROOT / "patches/sglang" / f"v{version}").glob("*.patch"))
    touched = {rel for pf in files for rel, _ in patch.parse(pf.read_text())}
    assert touched == set(PATCHED)
    for pf in files:
        changed = [
            line for line in pf.read_text().splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        assert len(changed) <= 12, (pf.name, len(changed))


def test_unknown_version_is_a_clear_error(site):
    r = cli("check", "--site-packages", str(site), "--version", "0.4.0")
    assert r.returncode == 1 and "no patches for SGLang 0.4.0" in r.stderr
