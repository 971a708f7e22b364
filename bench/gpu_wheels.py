"""Build the wheel folder an offline GPU machine needs to run this package (``make gpu-wheels``; docs/gpu.md).

    python -m bench.gpu_wheels [--out wheels] [--dry-run]

Run it on a machine with network and a torch install (DeepSpeed's wheel is built against the torch it finds), from
the root of a checkout. It does what worked for the first GPU run (one H200, 2026-11-26): the GPU machines hold Python
3.12, torch with CUDA, transformers, accelerate, PEFT, pyarrow, pandas, numpy — but not TRL, datasets, DeepSpeed or
pydantic, and have no network. So it

1. downloads, without dependencies, the binary wheels of the packages below for CPython 3.12 on manylinux x86-64
   (``pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform ...``: the
   wheels are chosen for the GPU machine, not for this one);
2. builds DeepSpeed's wheel (it ships a source archive only) with ``pip wheel --no-deps --no-build-isolation``: no
   isolated build environment, so it builds against the torch installed here, with no ops compiled ahead of time;
3. prints the commands to run on the GPU machine: ``pip install --no-index --no-deps --target /tmp/site`` of every
   wheel, then ``PYTHONPATH=<checkout>:/tmp/site``.

``--dry-run`` prints the commands without running them. ``wheels/`` is ignored by git; carry it over with the checkout.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What the first GPU run installed from wheels (versions as installed there; the unpinned ones are pure Python helpers
# of pydantic and math-verify whose newest release worked).
PACKAGES = (
    "trl==1.16.0", "transformers==5.24.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "peft==0.21.2",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types", "typing-inspection", "typing_extensions", "hjson",
    "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime==4.13.2",
)  # fmt: skip
DEEPSPEED = "deepspeed==0.19.8"
SITE = "/tmp/site"


def download_command(out: str, python: str = sys.executable) -> list[str]:
    """``pip download`` of :data:`PACKAGES` as binary wheels for the GPU machine's Python and platform."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", *platforms, "-d", out, *PACKAGES]  # fmt: skip


def deepspeed_command(out: str, python: str = sys.executable) -> list[str]:
    """``pip wheel`` of DeepSpeed against this environment's torch (no build isolation, no dependencies)."""
    return [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, DEEPSPEED]


def install_lines(out: str) -> list[str]:
    """The shell lines to run on the GPU machine, from the root of the checkout the wheel folder came with."""
    return [f"python3 -m pip install -q --no-index --no-deps --no-compile --target {SITE} {shlex.quote(out)}/*.whl",
            f"export PYTHONPATH=$PWD:{SITE}"]  # fmt: skip


def main(argv=None) -> list[list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="wheels", help="the wheel folder (default: wheels, ignored by git)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    commands = [download_command(args.out), deepspeed_command(args.out)]
    for command in commands:
        print("$ " + shlex.join(command), flush=True)
        if not args.dry_run:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            subprocess.run(command, check=True)
    if not args.dry_run:
        wheels = sorted(Path(args.out).glob("*.whl"))
        size = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"{len(wheels)} wheels, {size:.0f} MiB in {args.out}/", flush=True)
    print("# on the GPU machine, from the root of the checkout:")
    print("\n".join(install_lines(args.out)), flush=True)
    return commands


if __name__ == "__main__":
    main()
