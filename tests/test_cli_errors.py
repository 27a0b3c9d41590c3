"""Every entry point answers a user's mistake (here: a path that does not exist) with one line that
names it and a non-zero exit, never a traceback; a bug still shows its traceback."""

import subprocess
import sys

import pytest

MISSING = "/nonexistent/hs-recipe-test"
ENTRY_POINTS = {
    "recipe": ["recipe", f"model.path={MISSING}", "output_dir=OUT"],
    "recipe.serve": ["recipe.serve", "backend=sglang", f"model.path={MISSING}"],
    "shards inspect": ["recipe.shards", "inspect", MISSING],
    "shards verify": ["recipe.shards", "verify", MISSING],
    "shards export": ["recipe.shards", "export", "--to", "specforge", MISSING, "OUT/sf"],
    "shards rebuild-index": ["recipe.shards", "rebuild-index", MISSING],
    "shards merge": ["recipe.shards", "merge", "OUT/m", MISSING],
    "recipe.patch": ["recipe.patch", "check", "--site-packages", MISSING],
}


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_bad_path_is_one_line_naming_it(name, tmp_path):
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in ENTRY_POINTS[name]]
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    said = r.stdout + r.stderr
    assert r.returncode != 0, said
    assert "Traceback" not in said, said
    errors = [line for line in said.splitlines() if MISSING in line]
    assert errors and len(errors) <= 2, said  # the message (and at most the command echoed in a log line)


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """Only UserError becomes one line: an internal error is not swallowed into a message."""
    from recipe.shards import __main__ as cli

    def broken(root):
        raise ValueError("an internal invariant")

    monkeypatch.setattr(cli, "inspect", broken)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="an internal invariant"):
        cli.main(["inspect", "--json", str(tmp_path / "d")])


def test_an_empty_output_dir_is_refused_rather_than_the_current_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "recipe", "output_dir="], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "output_dir= is empty" in r.stdout + r.stderr
    assert not list(tmp_path.glob("*.jsonl")) and not (tmp_path / "shards").exists()


def test_a_failure_inside_the_packer_ends_the_process_with_one_line(tmp_path):
    """A damaged file met by the packer's own thread (shards/NEXT, read when a worker opens a new
    shard): the committer, the workers and the process all end, with one line and exit 2."""
    common = [f"capture.dump_dir={tmp_path / 'shm'}", "log_every_s=1000", "shards.max_shard_gb=0.00001"]
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "recipe", f"output_dir={out}", *common]
    first = subprocess.run([*argv, "data.limit=2"], capture_output=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (out / "shards" / "NEXT").write_text("garbage")
    r = subprocess.run(
        [*argv, "data.limit=4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,  # a thread left waiting would keep the process alive: this would time out
    )
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in said and f"{out / 'shards' / 'NEXT'} is damaged" in said, said


def test_help_lists_the_groups_options_and_not_the_internal_schemas(tmp_path):
    r = subprocess.run([sys.executable, "-m", "recipe", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "backend: hf, sglang\n" in r.stdout and "_schema" not in r.stdout
    assert "experiment: cpu, gpt-oss-120b, kimi-k2.5, llama-3.1-8b, tiny-sglang" in r.stdout


@pytest.mark.parametrize("code,status", [(None, 0), (3, 3), ("a message", 1)])
def test_the_exit_that_skips_teardown_keeps_status_output_threads_and_exit_handlers(code, status):
    """`python -m recipe` ends with exit_without_teardown: the status is sys.exit's for the same
    code, buffered output is not lost, a running non-daemon thread and the exit handlers finish."""
    snippet = (
        "import atexit, sys, threading, time\n"
        "from recipe.procs import exit_without_teardown\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished'))).start()\n"
        "sys.stdout.write('buffered, no newline')\n"
        f"exit_without_teardown({code!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert r.returncode == status, r
    assert "buffered, no newline" in r.stdout and "thread finished" in r.stdout and "exit handler ran" in r.stdout
    assert r.stderr == ("a message\n" if isinstance(code, str) else "")
