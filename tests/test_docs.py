"""The docs cannot drift from the code: every shell command in README.md and docs/ is taken from the
Markdown itself and checked. Each ```bash block is marked just above it:
- `<!-- docs: cpu -->`: every command runs, page after page in one folder, with /tmp/ moved into
  the test's own (the slow group);
- `<!-- docs: gpu -->`: needs a GPU host, a cluster or Docker. Each command is checked here: a
  `python -m recipe` line composes with its overrides (`--cfg job`; a sweep's first point), a
  `python -m recipe.shards`/`recipe.patch` line parses with that CLI, a `docker compose` line names
  a service and profile compose.yaml has;
- `<!-- docs: setup -->`: installs, which .ci/run does in its own form.
Links between the pages are checked too, anchors included.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
ORDER = ["README.md", "docs/data.md", "docs/configuration.md", "docs/training.md", "docs/scaling.md",
         "docs/guarantees.md", "docs/design.md"]  # fmt: skip
KINDS = ("cpu", "gpu", "setup")
SKIP = {"python -m pytest -q -n auto": "the test command itself: CI runs it, and it runs this test"}


def blocks(page: str) -> list[tuple[str, list[str]]]:
    """(kind, commands) for each ```bash block of a page; a block without a marker is kind None."""
    lines, out = (ROOT / page).read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        above = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        m = re.fullmatch(r"<!-- docs: (\w+) -->", above)
        body = lines[i + 1 : lines.index("```", i + 1)]
        out.append((m.group(1) if m else None, commands(body)))
    return out


def commands(body: list[str]) -> list[str]:
    """The commands of a block as written (globs, substitutions): comments dropped, continued lines joined."""
    text = "\n".join(body).replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in text.splitlines() if shlex.split(line, comments=True)]


@pytest.mark.parametrize("page", PAGES)
def test_every_shell_block_says_where_it_runs(page):
    assert all(kind in KINDS for kind, _ in blocks(page)), f"{page}: a ```bash block without <!-- docs: KIND -->"


def first_point(arg: str) -> str:
    """A sweep override's first value (`k=a,b` -> `k=a`, `k=range(8)` -> `k=0`)."""
    key, _, value = arg.partition("=")
    if value.startswith("range("):
        return f"{key}=0"
    depth = 0
    for i, ch in enumerate(value):
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            return f"{key}={value[:i]}"
    return arg


def check_gpu_command(cmd: str) -> None:
    for part in cmd.split("&&"):
        words = [w for w in shlex.split(part) if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # VAR=... prefixes
        if words[:3] == ["python", "-m", "recipe"]:
            args = [first_point(w) if "=" in w else w for w in words[3:] if w != "-m"]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            r = subprocess.run([sys.executable, "-m", "recipe", *args, "--cfg", "job"], capture_output=True,
                               text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
            assert r.returncode == 0, f"{cmd}: {r.stderr[-500:]}"
        elif words[:3] == ["python", "-m", "recipe.shards"]:
            from recipe.shards.__main__ import parser

            parser().parse_args(words[3:])
        elif words[:3] == ["python", "-m", "recipe.patch"]:
            r = subprocess.run([sys.executable, "-m", "recipe.patch", "--help"], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            choices = re.search(r"\{([\w,]+)\}", r.stdout).group(1).split(",")
            assert words[3] in choices, cmd
        elif words[:2] == ["docker", "compose"]:
            check_compose(words[2:], cmd)
        elif words[:2] == ["bash", "tests/gpu/device.sh"]:
            modes = re.findall(r"^  ([a-z-]+)\)", (ROOT / words[1]).read_text(), re.M)
            assert words[2] in [*modes, "install"], cmd
        elif words[0] == "cp":
            assert (ROOT / words[1]).exists(), cmd
        else:
            assert words[:2] == ["pip", "install"], f"{cmd}: no check for this command"


def check_compose(args: list[str], cmd: str) -> None:
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    if args[:1] == ["--profile"]:
        assert args[1] in profiles, cmd
        args = args[2:]
    assert args[0] in ("build", "up", "run", "down", "stop"), cmd
    if args[0] == "run":
        service = next(a for a in args[1:] if not a.startswith("-"))
        assert service in services, cmd
    if "--exit-code-from" in args:
        assert args[args.index("--exit-code-from") + 1] in services, cmd


@pytest.mark.parametrize("page", PAGES)
def test_every_gpu_and_docker_command_is_one_the_code_accepts(page):
    for kind, cmds in blocks(page):
        for cmd in cmds if kind == "gpu" else []:
            check_gpu_command(cmd)


@pytest.mark.slow
def test_every_cpu_command_of_the_docs_runs(tmp_path):
    """Page after page (README first: later pages use its /tmp/hs), in one working folder."""
    assert set(ORDER) >= {p for p in PAGES if any(k == "cpu" for k, _ in blocks(p))}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = 0
    for page in ORDER:
        for kind, cmds in blocks(page):
            for cmd in cmds if kind == "cpu" else []:
                if cmd in SKIP:
                    continue
                here = cmd.replace("/tmp/", f"{tmp_path}/")
                r = subprocess.run(["bash", "-c", here], cwd=tmp_path, env=env, capture_output=True, text=True,
                                   timeout=300)  # fmt: skip
                assert r.returncode == 0, f"{page}: {cmd}\n{(r.stdout + r.stderr)[-1500:]}"
                ran += 1
    assert ran >= 15


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_leads_somewhere(page):
    text = (ROOT / page).read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, frag = target.partition("#")
        dest = (ROOT / page).parent / path if path else ROOT / page
        assert dest.exists(), f"{page}: {target}"
        if frag:
            heads = [anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)]
            assert frag in heads, f"{page}: #{frag} is no heading of {path or page}"
