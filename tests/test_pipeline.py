"""The README's promise, as a user runs it: the embedded default, then verify, in fresh processes."""

import json
import subprocess
import sys

from conftest import recipe_cli


def test_embedded_default_then_verify(tmp_path):
    out = tmp_path / "x"
    r = recipe_cli(tmp_path, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "input 40 = ok 40" in r.stderr + r.stdout
    v = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples"] == 40 and m["counts"]["ok"] == 40
    assert not list((tmp_path / "shm").glob("user-*/run-*"))  # the RAM-disk folder is removed


def test_bad_input_is_accounted_and_the_run_goes_on(tmp_path):
    data = tmp_path / "d.jsonl"
    good = [
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
        for i in range(6)
    ]
    data.write_text("\n".join(good[:3] + ["{oops", json.dumps({"prompt": 3})] + good[3:]) + "\n")
    out = tmp_path / "o"
    r = recipe_cli(
        tmp_path,
        "data=jsonl",
        f"data.sources=[{data}]",
        "data.max_failures=2",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["input"] == 8 and c["ok"] == 6 and c["skipped"] == {"invalid_json": 1, "bad_field_type": 1}
    assert "skipped invalid_json: 1  e.g. d.jsonl:4" in r.stdout + r.stderr
