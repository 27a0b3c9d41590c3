"""Build the package's C loops in place (recipe/shards/_join.c, _fp8.c), as pip builds them on install,
for a GPU host that runs the recipe from its source tree: without them fp8 packs ~5x slower (numpy).
The sources and flags are pyproject's; a loop that fails to build is left to numpy, and said."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    mods = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    include = sysconfig.get_paths()["include"]
    for m in mods:
        target = ROOT / (m["name"].replace(".", "/") + ".abi3.so")
        newest = max((ROOT / src).stat().st_mtime for src in m["sources"])
        if target.exists() and target.stat().st_mtime >= newest:  # built from these sources already
            continue
        flags = ["-shared", "-fPIC", f"-I{include}", *m.get("extra-compile-args", [])]
        cmd = ["cc", *flags, *m["sources"], "-o", str(target)]
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            why = "" if done.returncode == 0 else done.stderr.strip()[-300:]
        except FileNotFoundError:
            why = "no C compiler (cc)"
        print(f"{m['name']}: {'not built, numpy: ' + why if why else 'built'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
