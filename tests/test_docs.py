"""The Python blocks of README.md and docs/*.md run as written, so the docs cannot drift from the code.

Every ```python block is preceded by one marker line:

- `<!-- doc: run -->`: executed. The runnable blocks of one file run in order in one fresh interpreter (later blocks
  see earlier blocks' names), in an empty working directory where `tests/` and `recipes/` point into the repository.
- `<!-- doc: hub -->`: needs the Hub or a large model; not run. The page gives a runnable twin next to it.
- `<!-- doc: fragment -->`: a signature or an excerpt, not a program; not run.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:^[ \t]*<!-- doc: (\w+) -->\n)?^[ \t]*```python\n(.*?)^[ \t]*```", re.M | re.S)
KINDS = ("run", "hub", "fragment")


def blocks(page: Path) -> list[tuple[int, str | None, str]]:
    """`(line, marker, code)` of every Python block of `page`."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1), textwrap.dedent(m.group(2))) for m in _BLOCK.finditer(text)]


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_python_block_is_marked():
    unmarked = [f"{rel(p)}:{line}" for p in PAGES for line, kind, _ in blocks(p) if kind not in KINDS]
    assert not unmarked, f"Python blocks without a `<!-- doc: run|hub|fragment -->` line before them: {unmarked}"


def test_hub_blocks_have_a_runnable_twin_on_their_page():
    lonely = [rel(p) for p in PAGES if any(k == "hub" for _, k, _ in blocks(p)) and not any(
        k == "run" for _, k, _ in blocks(p))]
    assert not lonely, f"pages with hub-only blocks and no runnable block: {lonely}"


RUNNABLE = [p for p in PAGES if any(kind == "run" for _, kind, _ in blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_runnable_blocks_run(page, tmp_path, tiny_model_path):
    code = "\n".join(
        f"# --- {rel(page)}:{line}\n{block}" for line, kind, block in blocks(page) if kind == "run"
    )
    for name in ("tests", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TRL_DLLM_CACHE": str(Path(tiny_model_path).parent / "embedded-cache"),  # built once per session
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{rel(page)}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


# Paths the docs cite from other repositories (ESPO's `recipes/`), next to that repository's name.
UPSTREAM_PATHS = {"recipes/train.yaml", "recipes/run_gsm8k_llada.sh", "recipes/run_math_llada.sh",
                  "recipes/run_countdown_llada.sh", "recipes/run_sudoku_llada.sh"}
_REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:trl_dllm|tests|docs|recipes|bench)/[\w./-]*\w)(?![\w{*])")
_LINK = re.compile(r"\]\(([^)#\s]+)")


def test_docs_cite_only_files_in_the_repository():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for match in _REPO_PATH.finditer(text):
            path = match.group(1)
            if path not in UPSTREAM_PATHS and not (ROOT / path).exists():
                missing.append(f"{rel(page)}: {path}")
        for match in _LINK.finditer(text):
            target = match.group(1)
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                missing.append(f"{rel(page)}: link {target}")
        if re.search(r"DESIGN(\.md| ?§)", text):
            missing.append(f"{rel(page)}: DESIGN (not in the repository)")
    assert not missing, missing
