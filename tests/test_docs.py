"""The Python blocks of README.md and docs/*.md run as written, so the docs cannot drift from the code.

Every ```python block is preceded by one marker line:

- `<!-- doc: run -->`: executed. The runnable blocks of one file run in order in one fresh interpreter (later blocks
  see earlier blocks' names), in an empty working directory where `tests/` and `recipes/` point into the repository.
- `<!-- doc: hub -->`: needs the Hub or a large model; not run. The page gives a runnable twin next to it.
- `<!-- doc: fragment -->`: a signature or an excerpt, not a program; not run.
- `<!-- doc: long -->`: reads the output of a long run whose command the page gives next to it; not run.
"""

import json
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
KINDS = ("run", "hub", "fragment", "long")


def blocks(page: Path) -> list[tuple[int, str | None, str]]:
    """`(line, marker, code)` of every Python block of `page`."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1), textwrap.dedent(m.group(2))) for m in _BLOCK.finditer(text)]


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_python_block_is_marked():
    unmarked = [f"{rel(p)}:{line}" for p in PAGES for line, kind, _ in blocks(p) if kind not in KINDS]
    assert not unmarked, f"Python blocks without a `<!-- doc: run|hub|fragment|long -->` line before them: {unmarked}"


def test_hub_blocks_have_a_runnable_twin_on_their_page():
    lonely = [rel(p) for p in PAGES if any(k == "hub" for _, k, _ in blocks(p)) and not any(
        k == "run" for _, k, _ in blocks(p))]
    assert not lonely, f"pages with hub-only blocks and no runnable block: {lonely}"


RUNNABLE = [p for p in PAGES if any(kind == "run" for _, kind, _ in blocks(p))]

# Runs in one fresh interpreter (imports are paid once): each page's runnable blocks, concatenated in order, execute
# in their own namespace and their own working directory; the outcome of each page is written to a JSON file.
RUNNER = textwrap.dedent(
    """
    import json, os, sys, traceback
    pages, out = json.loads(sys.argv[1]), sys.argv[2]
    results = {}
    for name, (workdir, code) in pages.items():
        os.chdir(workdir)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
            results[name] = None
        except BaseException:
            results[name] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(results, f)
    """
)


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    pages = {}
    for page in RUNNABLE:
        workdir = root / rel(page).replace("/", "_")
        workdir.mkdir()
        for name in ("tests", "recipes"):
            (workdir / name).symlink_to(ROOT / name)
        code = "\n".join(f"# --- {rel(page)}:{line}\n{block}" for line, kind, block in blocks(page) if kind == "run")
        pages[rel(page)] = (str(workdir), code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TRL_DLLM_CACHE": str(root / "cache"),  # the embedded model is built once, by the first page that names it
    }
    out = root / "results.json"
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(pages), str(out)], env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0 and out.exists(), result.stderr[-4000:]
    return json.loads(out.read_text()), result.stdout + result.stderr


@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_runnable_blocks_run(page, page_results):
    results, output = page_results
    assert results[rel(page)] is None, f"{rel(page)}:\n{results[rel(page)]}\n--- output:\n{output[-3000:]}"


# Paths the docs cite from other repositories (ESPO's `recipes/`), next to that repository's name.
UPSTREAM_PATHS = {"recipes/train.yaml", "recipes/run_gsm8k_llada.sh", "recipes/run_math_llada.sh",
                  "recipes/run_countdown_llada.sh", "recipes/run_sudoku_llada.sh",
                  "recipes/LLaDA-Instruct/mdpo/config_demo.yaml"}  # MDPO's released config
_REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:trl_dllm|tests|docs|recipes|bench|studies)/[\w./-]*\w)(?![\w{*])")
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


_ANCHOR_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)


def heading_anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer (GitHub's rule) gives the headings of ``text``: lower case, every character but
    letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_heading_anchors_follow_githubs_rule():
    assert heading_anchors("# A `b` (c, d)\n```\n# not a heading\n```\n## A `b` (c, d)\n") == {"a-b-c-d", "a-b-c-d-1"}


def test_docs_links_to_headings_resolve():
    """Every `[...](page.md#anchor)` and `[...](#anchor)` of README.md and docs/ names a heading of its page."""
    anchors = {page.resolve(): heading_anchors(page.read_text()) for page in PAGES}
    broken = []
    for page in PAGES:
        text = page.read_text()
        for match in _ANCHOR_LINK.finditer(text):
            target = (page.parent / match.group(1)).resolve() if match.group(1) else page.resolve()
            if target in anchors and match.group(2) not in anchors[target]:
                broken.append(f"{rel(page)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
    assert not broken, broken
