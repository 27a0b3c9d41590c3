"""bench/draft.py's own plumbing, on the CPU: what its training processes are handed arrives whole."""

import sys

import pytest
from conftest import ROOT

if not (ROOT / "bench" / "draft.py").exists():  # inside the image (compose's test profile): no benches
    pytest.skip("bench/ is not in the image", allow_module_level=True)
sys.path.insert(0, str(ROOT / "bench"))
import draft  # noqa: E402


@pytest.mark.parametrize("export", [True, False])
def test_a_training_process_gets_its_config_and_the_sglang_export_options_whole(tmp_path, monkeypatch, export):
    """The export's options (`--to sglang --checkpoint ...`) are not this script's: argparse must never
    see them, or every served arm's training exits 2 before it starts."""
    got = []
    monkeypatch.setattr(draft, "sf_train", lambda *a: got.append(a) or 0)
    cfg, draft_json = tmp_path / "real.yaml", tmp_path / "draft.json"
    argv = draft.sftrain_argv(tmp_path, "real", cfg, draft_json, export)
    assert draft.main(argv) == 0
    expected = ("real", str(cfg), *(draft.sglang_export_args(tmp_path, "real", draft_json) if export else ()))
    assert got == [expected]
    assert ("--to" in expected) == export
