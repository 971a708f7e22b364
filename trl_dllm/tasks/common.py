"""What every task builder shares: loading from a local file or the Hub, and building TRL prompts."""

from __future__ import annotations

import csv
import glob
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets

# d1's answer format, which `xml_format_reward` scores and every correctness reward reads the answer from.
XML_SYSTEM_PROMPT = """Think through the problem step by step, then reply in exactly this format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""

DataFiles = str | Sequence[str] | dict[str, str | Sequence[str]]
_BUILDERS_BY_SUFFIX = {".csv": "csv", ".parquet": "parquet"}  # anything else is read as JSON / JSON Lines


def _paths(data_files: DataFiles) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [p for value in data_files.values() for p in _paths(value)]
    return [p for value in data_files for p in _paths(value)]


def _csv_string_features(path: str) -> datasets.Features:
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _load_local(data_files: DataFiles, split: str) -> datasets.Dataset:
    for path in _paths(data_files):
        remote = "://" in path
        pattern = any(c in path for c in "*?[")
        if not remote and not (glob.glob(path) if pattern else Path(path).exists()):
            raise FileNotFoundError(f"Task data file not found: {path}")
    first = _paths(data_files)[0]
    builder = file_builder(first)
    if builder == "json":
        for path in _paths(data_files):
            if "://" not in path:
                for file in glob.glob(path) if any(c in path for c in "*?[") else [path]:
                    check_json_lines(file)
    # CSV columns stay strings: pandas would read the puzzle "0140432014020000" as an int and drop its zero.
    options = {"features": _csv_string_features(first)} if builder == "csv" else {}
    file_split = split if isinstance(data_files, dict) else "train"  # `datasets` names a lone file's split "train"
    return datasets.load_dataset(builder, data_files=data_files, split=file_split, **options)


def file_builder(path: str) -> str:
    """The `datasets` builder a task reads a local file with, by suffix: ``csv``, ``parquet``, else ``json`` (JSON or
    JSON Lines)."""
    return _BUILDERS_BY_SUFFIX.get(Path(path).suffix.lower(), "json")


def has_rows(path: str, builder: str) -> bool:
    """Whether the local file ``path`` holds a row for the `datasets` builder ``builder``: a CSV file a line after its
    header, a JSON document a non-empty list or an object, a JSON Lines file a non-blank line (a malformed one is
    :func:`check_json_lines`'s to report). Other builders (parquet) are not read here: ``True``."""
    if builder not in ("csv", "json"):
        return True
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if builder == "csv":
        return len(lines) > 1
    try:
        document = json.loads("\n".join(lines)) if lines else []
    except ValueError:
        return True  # JSON Lines (or malformed): a non-blank line
    return bool(document) if isinstance(document, list) else True


class DataFileError(ValueError):
    """A local data file that `datasets` cannot read: a malformed JSON Lines line."""


def check_json_lines(path: str) -> None:
    """A JSON file (one document) or JSON Lines file (one object per line) parses; else a [`DataFileError`] naming
    the first bad line, before `datasets` fails with a `DatasetGenerationError` traceback."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        json.loads(text)
        return
    except ValueError:
        pass  # not one JSON document: JSON Lines, checked line by line
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataFileError(
                f"data_files: {path} line {number} is not valid JSON ({err.msg}, column {err.colno}): "
                f"{line.strip()[:60]!r}. Fix or delete that line (JSON Lines: one object per line)."
            ) from None
        if not isinstance(row, dict):
            raise DataFileError(
                f"data_files: {path} line {number} is a JSON {type(row).__name__}, not an object of "
                "column: value pairs. Write one object per line."
            )


def _load_hub(hub_id: str, hub_config: str | None, split: str, required_columns: Sequence[str]) -> datasets.Dataset:
    try:
        return datasets.load_dataset(hub_id, hub_config, split=split)
    except Exception as err:  # offline, unknown id, gated, no such split: all mean "use a local file"
        config = f" (config {hub_config!r})" if hub_config else ""
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise RuntimeError(
            f"Could not load dataset {hub_id!r}{config}, split {split!r}, from the Hugging Face Hub "
            f"({type(err).__name__}: {reason}); pass a local JSON/JSONL file with data_files=... "
            f"(columns: {', '.join(required_columns)})."
        ) from err


def load_source(
    hub_id: str,
    hub_config: str | None,
    split: str,
    data_files: DataFiles | None,
    required_columns: Sequence[str],
    rename: dict[str, str] | None = None,
) -> datasets.Dataset:
    """
    The raw dataset of a task: from `data_files` if given, else from the Hub.

    Args:
        hub_id (`str`):
            Hub dataset id, used only when `data_files` is `None`.
        hub_config (`str` or `None`):
            Hub configuration name (`"main"` for GSM8K).
        split (`str`):
            Split to load from the Hub, or the key of `data_files` when it is a dict. A single file (or list of
            files) is the whole dataset, whatever `split` says.
        data_files (`str`, `list[str]`, `dict[str, str]` or `None`):
            Local JSON / JSON Lines files (`.csv` and `.parquet` are read as such).
        required_columns (`Sequence[str]`):
            Columns the task builder reads; a missing one raises `ValueError`.
        rename (`dict[str, str]`, *optional*):
            Source column names to rename before the check (d1's sudoku CSV says `Puzzle`, we say `puzzle`).

    Raises:
        `FileNotFoundError`: a local path does not exist.
        `RuntimeError`: the Hub dataset could not be loaded (offline, unknown id, …); the message says to pass a
            local file instead.
        `ValueError`: a required column is missing.
    """
    if data_files is not None:
        dataset, source = _load_local(data_files, split), f"data_files={data_files!r}"
    else:
        dataset, source = _load_hub(hub_id, hub_config, split, required_columns), repr(hub_id)
    renames = {old: new for old, new in (rename or {}).items() if old in dataset.column_names}
    renames = {old: new for old, new in renames.items() if new not in dataset.column_names}
    if renames:
        dataset = dataset.rename_columns(renames)
    missing = [c for c in required_columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"Dataset {source} lacks column(s) {', '.join(missing)}; it has: {', '.join(dataset.column_names)}. "
            f"Rename the column that holds it (e.g. jq or dataset.rename_column(old, {missing[0]!r})) or pick the "
            "task whose data this is."
        )
    return dataset


def make_prompt(user_content: str, system_prompt: str | None, conversational: bool) -> str | list[dict[str, str]]:
    """
    A prompt in TRL's conversational format (`[{"role": "system", ...}, {"role": "user", ...}]`, the system message
    only if `system_prompt` is non-empty) or, with `conversational=False`, one string: system prompt, blank line,
    user content.
    """
    if conversational:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return messages + [{"role": "user", "content": user_content}]
    return f"{system_prompt}\n\n{user_content}" if system_prompt else user_content


def build_prompts(
    raw: datasets.Dataset,
    to_example: Callable[[dict[str, Any]], tuple[str, dict[str, Any]]],
    system_prompt: str | None,
    conversational: bool,
) -> datasets.Dataset:
    """
    Map each raw row to `{"prompt": ..., **reward_columns}` and drop the raw columns.

    `to_example(row)` returns the user message and the columns the task's rewards read.
    """

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        user_content, columns = to_example(row)
        return {"prompt": make_prompt(user_content, system_prompt, conversational), **columns}

    return raw.map(convert, remove_columns=raw.column_names)
