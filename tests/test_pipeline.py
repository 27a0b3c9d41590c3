"""The README's promise, as a user runs it: the embedded default, then verify, in fresh processes."""

import json
import re
import subprocess
import sys

import pytest
from conftest import recipe_cli, small_run_cfg


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
    assert "every sample computed" in r.stdout + r.stderr and "the last samples stored" in r.stdout + r.stderr
    tail = re.search(r"after the last was computed \(the last dump seen ([-+][\d.]+) s, handed to a worker "
                     r"([-+][\d.]+) s, packed ([-+][\d.]+) s\)", r.stdout + r.stderr)  # fmt: skip
    assert tail, "the tail's steps"
    seen, handed, packed = map(float, tail.groups())
    assert seen <= handed <= packed


def test_sizes_and_rates_are_printed_in_units_that_fit():
    from recipe.units import duration, rate, size

    assert [size(x) for x in (0, 512, 12_345, 5.9e6, 4.56e9)] == ["0 B", "512 B", "12.3 KB", "5.9 MB", "4.56 GB"]
    assert size(4_000) != "0.0 GB" and rate(30_100, "tok") == "30.1 Ktok/s"
    assert [duration(x) for x in (3.21, 245, 7800)] == ["3.2 s", "4m05s", "2h10m"]


def test_progress_counts_from_the_capture_start_and_gives_an_eta(monkeypatch):
    from recipe.packer import Progress

    clock = [100.0]
    monkeypatch.setattr("recipe.packer.progress.time.monotonic", lambda: clock[0])
    p = Progress(total=10, every_s=1e9)
    clock[0] += 200  # the server starting: not part of the rates
    p.start()
    clock[0] += 10
    for _ in range(5):
        p.add(tokens=1000, raw=2_000_000, stored=1_000_000)
    line = p.line()
    assert "packed 5/10 (failed 0) in 10.0 s | 0.5 samples/s | 500 tok/s" in line
    assert "raw 1 MB/s, stored 500 KB/s (ratio 2.000x) | ETA 10.0 s" in line


def test_progress_is_quiet_until_the_capture_starts_and_then_notes_a_slow_first_sample(monkeypatch, caplog):
    """While the server starts, the backend says what it waits for: no "0 samples/s" lines, and no
    note about kernels compiling in the first batch before there is a batch."""
    from recipe.packer import Progress

    clock = [100.0]
    monkeypatch.setattr("recipe.packer.progress.time.monotonic", lambda: clock[0])
    p = Progress(total=10, every_s=5)
    with caplog.at_level("INFO", logger="recipe.packer"):
        for _ in range(60):  # five minutes of a server starting
            clock[0] += 5
            p.maybe_log()
        assert caplog.messages == []
        p.start()
        clock[0] += 31
        p.maybe_log()
    assert "no sample packed 31 s into the capture" in caplog.messages[0]
    assert "packed 0/10 (failed 0) in 31.0 s" in caplog.messages[1]


def test_the_runs_tail_is_reported_from_the_last_computed_sample_to_the_last_stored(monkeypatch, caplog):
    """At the end of a long run the server has answered everything and the packer still stores: the
    log says so, how long that tail took, counted from the capture's start, and when the last sample
    went through each of its steps."""
    from recipe.packer import Progress

    clock = [100.0]
    monkeypatch.setattr("recipe.packer.progress.time.monotonic", lambda: clock[0])
    p = Progress(total=10, every_s=1e9)
    with caplog.at_level("INFO", logger="recipe.packer"):
        p.computed(3)  # before the capture starts (nothing computed): quiet
        clock[0] += 200
        p.start()
        clock[0] += 70
        p.mark("dumped")
        clock[0] += 0.25
        p.computed(3)
        for step in ("dispatched", "packed"):
            clock[0] += 0.1
            p.mark(step)
        clock[0] += 0.3
        p.drained()
    assert caplog.messages == [
        "every sample computed 1m10s into the capture; 3 left to store",
        "the last samples stored 0.5 s after the last was computed (the last dump seen -0.25 s, handed to a "
        "worker +0.10 s, packed +0.20 s)",
    ]


def test_a_damaged_builtin_model_cache_is_rebuilt(tmp_path, monkeypatch):
    from recipe import models

    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path))
    d = models.materialize("tiny-llama")
    w = d / "model.safetensors"
    good = w.read_bytes()
    w.write_bytes(good[: len(good) // 2])  # a copy cut short
    assert models.materialize("tiny-llama") == d and w.read_bytes() == good  # deterministic weights: rebuilt equal


@pytest.mark.timeout(60)  # a sample the backend neither dumps nor fails is waited for: fail fast, not hang
def test_a_batch_whose_forward_fails_is_counted_and_the_run_fails(tmp_path, monkeypatch):
    """The HF backend's failure path: each sample of the batch a failed `forward_error`, a non-zero
    exit; the other batches stored."""
    from recipe.backends.hf import HFBackend
    from recipe.main import RunFailed, run

    real, calls = HFBackend.hidden_states, []

    def flaky(self, batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, batch)

    monkeypatch.setattr(HFBackend, "hidden_states", flaky)
    with pytest.raises(RunFailed, match="forward_error"):
        run(small_run_cfg(tmp_path, "backend.batch_size=2", limit=6))
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert sum(m["counts"]["failed"].values()) == 2 and m["counts"]["ok"] == 4 and m["counts"]["not_done"] == 0


def test_a_resume_with_nothing_to_do_loads_no_model(tmp_path, monkeypatch):
    from recipe import main

    assert main.run(small_run_cfg(tmp_path, limit=3))["ok"] == 3

    def no(*a, **k):
        raise AssertionError("a backend was made for a resume with nothing to do")

    monkeypatch.setattr(main, "make_backend", no)
    counts = main.run(small_run_cfg(tmp_path, limit=3))
    assert counts["ok"] == counts["already_stored"] == 3 and counts["ok_this_run"] == 0
