"""Recipes and flags → dataclasses, with TRL's `TrlParser` and one-line errors that name the field or path.

A recipe is TRL's YAML config: a flat mapping of field names of the script's dataclasses, plus an optional `env:`
mapping of environment variables to set. On top of `TrlParser` this adds:

- `${VAR}` in a string value is replaced by the environment variable `VAR`, `${VAR:-default}` by `default` when `VAR`
  is unset or empty (tiny recipes read `${TRL_DLLM_TINY_MODEL:-tiny}`: the embedded tiny model unless the variable
  names another); an unset variable without a default is an error unless the field is also given on the command line;
- an unknown field (in the recipe or as a flag) is an error naming it, with the closest known field;
- argparse's errors (bad values) raise instead of printing the multi-hundred-line usage of `GRPOConfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import yaml
from trl import TrlParser

from ..config_checks import REMOVED_ARGUMENTS
from ..errors import UsageError
from ..training.inputs import FieldTypeError, RewardFunctionError

_ENV_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


# Errors that mean "bad input" while a script sets up (parsing, data, rewards, model path, config checks). Errors
# raised later, during training, keep their traceback. A recipe value of the wrong type (`mc_samples: 2.5`) and a reward
# function whose signature or return value TRL cannot use are TypeErrors, and bad input as well.
SETUP_ERRORS = (UsageError, ValueError, FileNotFoundError, RuntimeError, FieldTypeError, RewardFunctionError)


@contextlib.contextmanager
def exit_on_bad_input(
    prog: str, errors: tuple[type[BaseException], ...] = SETUP_ERRORS, fresh_line: bool = False
) -> Iterator[None]:
    """Turn a setup error (one of ``errors``) into one line on stderr, `<prog>: error: <message>`, and exit status 2.
    With ``fresh_line`` (errors found while training) the line starts after a newline: a progress bar may hold the
    current one.

    Set `TRL_DLLM_TRACEBACK=1` to get the traceback instead.
    """
    try:
        yield
    except errors as err:
        if os.environ.get("TRL_DLLM_TRACEBACK") == "1":
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"{chr(10) if fresh_line else ''}{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


# Section titles of `--help` for the dataclasses without `> Parameters that control ...` headings in their docstring.
_TITLES = {
    "GRPOScriptArguments": "data and rewards",
    "EvalArguments": "evaluation",
    "ModelConfig": "model and LoRA (TRL's ModelConfig)",
}
_HEADING = re.compile(r"^\s*> Parameters that control (.+?)\s*$")
_DOC_FIELD = re.compile(r"^\s+(\w+) \(`")


class ScriptParser(TrlParser):
    """`TrlParser` whose argparse errors raise `UsageError` (the default prints the full usage, then exits), which
    takes no abbreviated flags (`--num_iteration` is a typo, not `--num_iterations`), and whose `--help` lists
    `--config`, then the fields of trl_dllm grouped as in `DiffusionGRPOConfig`'s docstring, then TRL's."""

    def __init__(self, dataclass_types, **kwargs):
        prog = kwargs.get("prog") or "trl-dllm"
        kwargs.setdefault("usage", f"{prog} [--config RECIPE.yaml] [--field value ...]")
        kwargs.setdefault(
            "description",
            "Every field can be set in the YAML recipe (--config) or as a flag; flags override the recipe. The fields "
            "of trl_dllm come first, grouped; those of TRL's GRPOConfig and transformers' TrainingArguments last.",
        )
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)

    def format_help(self) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, [])
        formatter.add_text(self.description)
        config = argparse.Action(
            ["--config"], dest="config", metavar="RECIPE.yaml", default=argparse.SUPPRESS,
            help="YAML recipe: a mapping of the fields below, plus an optional `env:` mapping of environment "
            "variables; ${VAR} and ${VAR:-default} expand from the environment (docs/cli.md).",
        )
        by_dest: dict[str, list[argparse.Action]] = {}
        for action in self._actions:
            by_dest.setdefault(action.dest, []).append(action)
        sections = [("recipe", [config, *by_dest.get("help", [])]), *self._field_sections()]
        for title, names in sections:
            actions = [a for name in names for a in (by_dest.get(name, []) if isinstance(name, str) else [name])]
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help()

    def _field_sections(self) -> list[tuple[str, list[str]]]:
        """(title, field names) of each dataclass: the headed groups of its docstring (the trl_dllm fields of
        `DiffusionGRPOConfig`) in order, its other fields after all the dataclasses' own."""
        first, last = [], []
        for cls in self.dataclass_types:
            names = [f.name for f in dataclasses.fields(cls) if f.init]
            groups, title = [], None
            for line in (cls.__doc__ or "").splitlines():
                if heading := _HEADING.match(line):
                    title = heading.group(1).removeprefix("the ")
                    groups.append((title, []))
                elif title is not None and (doc_field := _DOC_FIELD.match(line)) and doc_field.group(1) in names:
                    groups[-1][1].append(doc_field.group(1))
            covered = {name for _, group in groups for name in group}
            others = [name for name in names if name not in covered]
            first.extend(groups)
            if groups and others:
                trl_base = next((b.__name__ for b in cls.__mro__ if b.__module__.startswith("trl.")), "GRPOConfig")
                last.append((f"inherited by {cls.__name__}: TRL's {trl_base} and transformers' TrainingArguments",
                             others))
            elif others:
                first.append((_TITLES.get(cls.__name__, cls.__name__), others))
        return first + last

    def error(self, message: str):
        raise UsageError(message)

    def field_names(self) -> set[str]:
        return {action.dest for action in self._actions if action.dest != "help"}

    def parse(self, argv: Sequence[str], defaults: dict[str, Any] | None = None) -> tuple[Any, ...]:
        """Parse `[--config recipe.yaml] [--field value ...]` into one instance per dataclass type.

        Flags override `defaults`, which override the recipe, which overrides the dataclass defaults.
        """
        argv = list(argv)
        config, source = {}, None
        if "--config" in argv:
            index = argv.index("--config")
            if index + 1 >= len(argv):
                raise UsageError("--config needs a path to a YAML recipe")
            source = argv[index + 1]
            del argv[index : index + 2]
            config = load_recipe(source, overridden=_flag_names(argv))
        known = self.field_names()
        for key in config:
            if key in REMOVED_ARGUMENTS:
                raise UsageError(f"{source}: {key}: {REMOVED_ARGUMENTS[key]}")
            if key not in known:
                raise UsageError(f"{source}: unknown field {key!r}{_suggestion(key, known)}")
        self.set_defaults_with_config(**{**config, **(defaults or {})})
        *outputs, remaining = self.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if remaining:
            flag = next((a for a in remaining if a.startswith("-")), remaining[0])
            name = flag.lstrip("-").split("=")[0]
            if name in REMOVED_ARGUMENTS:
                raise UsageError(f"{name}: {REMOVED_ARGUMENTS[name]}")
            raise UsageError(f"unknown argument {flag!r}{_suggestion(name, known, prefix='--')}")
        return tuple(outputs)


def load_recipe(path: str, overridden: Iterable[str] = ()) -> dict[str, Any]:
    """The recipe at `path` as a dict, after setting its `env:` variables and expanding `${VAR}` in its values.

    Fields in `overridden` (given as flags) are dropped from the recipe when they refer to an unset variable.
    """
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0]
        raise UsageError(f"{path}: not valid YAML ({first})") from err
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a recipe is a YAML mapping of field: value, got {type(config).__name__}")
    env = config.pop("env", None) or {}
    if not isinstance(env, dict):
        raise UsageError(f"{path}: `env` must be a mapping of VARIABLE: value")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    expanded = {}
    overridden = set(overridden)
    for key, value in config.items():
        try:
            expanded[key] = _expand(value)
        except KeyError as err:
            if key in overridden:
                continue
            raise UsageError(
                f"{path}: field {key!r} refers to ${{{err.args[0]}}}, which is not set; export it or pass --{key}"
            ) from None
    return expanded


def _variable(match: re.Match) -> str:
    """`${VAR}` → `$VAR` (KeyError when unset); `${VAR:-default}` → `$VAR`, or `default` when unset or empty."""
    name, default = match.group(1), match.group(2)
    if default is not None:
        return os.environ.get(name) or default
    return os.environ[name]


def _expand(value: Any) -> Any:
    if isinstance(value, str):
        return _ENV_VAR.sub(_variable, value)
    if isinstance(value, list):
        return [_expand(v) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    return value


def _flag_names(argv: Sequence[str]) -> set[str]:
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}  # `--max-steps` is max_steps


def _suggestion(name: str, known: Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
