"""Install the dependencies of an installed distribution, except the ones named (CPU test venvs).

    python scripts/install_deps.py DIST [--skip NAME ...] [--relax NAME ...] [-c CONSTRAINTS]

vLLM and SGLang pin CUDA builds of torch and a set of GPU kernel packages that neither install nor load on
a CPU machine, and that the MoE layers tested here never import. The serving test scripts install the
framework itself with --no-deps, then this installs the rest of its requirements (markers evaluated for
this interpreter): ``--skip`` drops a requirement, ``--relax`` keeps it without its version bound.
"""

import argparse
import importlib.metadata
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dist")
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--relax", nargs="*", default=[])
    ap.add_argument("-c", "--constraint", action="append", default=[])
    a = ap.parse_args()
    skip = {canonicalize_name(n) for n in a.skip}
    relax = {canonicalize_name(n) for n in a.relax}
    wanted = []
    for line in importlib.metadata.requires(a.dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in skip:
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        wanted.append(f"{req.name}{extras}" if name in relax else f"{req.name}{extras}{req.specifier}")
    cmd = [sys.executable, "-m", "pip", "install", "-q"] + [f"-c{c}" for c in a.constraint] + wanted
    print(" ".join(cmd[4:]), flush=True)
    subprocess.check_call(cmd)


if __name__ == "__main__":
    main()
