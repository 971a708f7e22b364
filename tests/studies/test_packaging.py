"""`studies/` is the repository's, not the package's: `trl_dllm` never imports it (only `trl-dllm compare` does, at
run time, through `cli._study`), the wheel does not ship it, and the CLI finds it from a clone or says what to do."""

import ast
import sys
from pathlib import Path

import pytest
from setuptools import find_packages

from trl_dllm import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_never_imports_the_studies():
    importers = []
    for path in sorted((ROOT / "trl_dllm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n.split(".")[0] in ("studies", "bench") for n in names):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not importers, importers


def test_the_wheel_leaves_the_studies_out():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = find_packages(str(ROOT), include=include)
    assert "trl_dllm.demo" in shipped and not [p for p in shipped if p.split(".")[0] in ("studies", "bench")]


def _forget_studies(monkeypatch):
    for name in [n for n in sys.modules if n == "studies" or n.startswith("studies.")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_cli_finds_the_studies_of_a_clone_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    _forget_studies(monkeypatch)
    assert cli._study("compare_methods").__file__ == str(ROOT / "studies" / "compare_methods.py")


def test_compare_without_the_studies_names_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(cli, "__file__", "/site-packages/trl_dllm/cli.py")  # a wheel: no studies/ beside it
    _forget_studies(monkeypatch)
    monkeypatch.setitem(sys.modules, "studies", None)  # and none importable elsewhere
    assert cli.main(["compare", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-dllm compare: error: the studies are not part of the installed package") and (
        "pip install -e ." in err and "python -m studies.compare" in err
    ), err
