"""bench/gpu_wheels.py: the commands that build an offline GPU machine's wheel folder, as they worked on the first
GPU run (checked as command lines with --dry-run: nothing is downloaded in the test suite)."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_wheels  # noqa: E402


def test_download_command_targets_the_gpu_machine():
    cmd = gpu_wheels.download_command("wheels", python="python")
    assert cmd[:5] == ["python", "-m", "pip", "download", "--no-deps"]
    flags = " ".join(cmd)
    assert "--only-binary=:all: --python-version 3.12 --implementation cp" in flags
    assert ("--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "
            "-d wheels") in flags  # fmt: skip
    packages = cmd[cmd.index("wheels") + 1 :]
    for pin in ("trl==1.16.0", "transformers==5.24.0", "datasets==5.2.0", "peft==0.21.2", "dill==0.4.1",
                "multiprocess==0.70.19", "pydantic==2.14.4", "pydantic-core==2.50.5", "antlr4-python3-runtime==4.13.2",
                "math-verify", "latex2sympy2_extended", "hjson", "annotated-types", "typing-inspection",
                "typing_extensions"):  # fmt: skip
        assert pin in packages, pin
    assert not any(p.startswith(("torch", "deepspeed", "accelerate")) for p in packages)  # on the machine / built


def test_deepspeed_is_built_against_the_local_torch():
    assert gpu_wheels.deepspeed_command("w", python="python") == [
        "python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", "w", "deepspeed==0.19.8"]


def test_dry_run_prints_and_runs_nothing(monkeypatch, capsys, tmp_path):
    def no_run(*args, **kwargs):
        raise AssertionError("--dry-run ran a command")

    monkeypatch.setattr(subprocess, "run", no_run)
    commands = gpu_wheels.main(["--dry-run", "--out", str(tmp_path / "wheels")])
    out = capsys.readouterr().out
    assert len(commands) == 2 and not (tmp_path / "wheels").exists()
    assert out.count("$ ") == 2 and "pip download --no-deps" in out and "pip wheel --no-deps" in out
    install = f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {tmp_path}/wheels/*.whl"
    assert install in out and "export PYTHONPATH=$PWD:/tmp/site" in out
