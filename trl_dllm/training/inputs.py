"""Checks of what a user hands the trainer — prompts, reward functions, the tokenizer beside the model, names of
models and rewards, recipe field types — each refusing with one line that names the field or row, the value and the
fix. The config's own checks (field types, loggers) live in `trl_dllm/config_checks.py`, re-exported here.

One exception type per kind, each a `ValueError` or `TypeError` so that code catching those keeps working.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import numbers
import os

from ..config_checks import (  # noqa: F401  (the config's own checks; their errors are caught by the CLI)
    FieldTypeError,
    LoggerLoginError,
    check_field_types,
    check_report_to,
    wandb_login_problem,
)
from ..errors import UsageError
from .watches import RewardFunctionError

CHAT_ROLES = ("system", "user", "assistant", "tool")  # TRL's roles


class PromptFormatError(ValueError):
    """A dataset's `prompt` value is neither a non-empty string nor a list of chat messages TRL can render."""


class ModelMismatchError(ValueError):
    """The tokenizer and the model do not fit together (ids beyond the model's embedding)."""


class NameNotFoundError(ValueError):
    """A model or reward name that is neither a local folder nor an embedded name, while the Hub is offline."""


# ---------------------------------------------------------------------------------------------------- names


def check_offline_name(field: str, value, known: dict | tuple, hint: str = "") -> None:
    """With the Hub offline, a string that is no local folder can only be one of ``known``: say which was meant."""
    if not isinstance(value, str) or os.path.exists(value) or value in known:
        return
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes", "on"):
        if os.environ.get("TRANSFORMERS_OFFLINE", "0").lower() not in ("1", "true", "yes", "on"):
            return
    close = difflib.get_close_matches(value, list(known), n=1, cutoff=0.5)
    guess = f" did you mean {close[0]!r}?" if close else f" known names: {', '.join(map(repr, known))}."
    raise NameNotFoundError(
        f"{field}={value!r}: no such local folder or embedded model;{guess}{hint} (HF_HUB_OFFLINE is set, so the Hub "
        "is not asked.)"
    )


# ---------------------------------------------------------------------------------------------------- prompts


def prompt_problem(prompt) -> str | None:
    """Why TRL cannot render ``prompt``, or `None`: a non-empty string, or a non-empty list of `{role, content}`
    messages with TRL's roles."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is an empty string"
    if not isinstance(prompt, (list, tuple)):
        return f"is {type(prompt).__name__} {prompt!r:.40}, not a string or a list of chat messages"
    if not prompt:
        return "is an empty list of messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"message {i} is {type(message).__name__}, not a {{'role', 'content'}} dict"
        if message.get("role") not in CHAT_ROLES:
            return f"message {i} has role {message.get('role')!r}; TRL's roles are {', '.join(CHAT_ROLES)}"
        if "content" not in message or message["content"] is None:
            return f"message {i} ({message['role']}) has no 'content'"
    return None


def check_prompts(name: str, dataset, scan_rows: int = 100_000) -> None:
    """Every `prompt` of a map-style dataset (the first ``scan_rows``) is one TRL renders."""
    if not hasattr(dataset, "__len__") or "prompt" not in (getattr(dataset, "column_names", None) or []):
        return
    prompts = dataset[: min(len(dataset), scan_rows)]["prompt"]
    for row, prompt in enumerate(prompts):
        problem = prompt_problem(prompt)
        if problem is not None:
            raise PromptFormatError(
                f"{name} row {row}: prompt {problem}. Each prompt is a non-empty string or a list of "
                "{'role': system|user|assistant|tool, 'content': ...} messages; fix or filter that row."
            )


# ---------------------------------------------------------------------------------------------------- rewards


def check_reward_functions(trainer) -> None:
    """Each plain-function reward accepts what TRL passes and, on one real row (twice, as a group), returns one
    number (or `None`) per completion. A function that raises on the made-up empty completion is not judged."""
    dataset = trainer.train_dataset
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    row = dataset[0]
    conversational = isinstance(row.get("prompt"), list)
    completion = [{"role": "assistant", "content": ""}] if conversational else ""
    extra = {key: [value, value] for key, value in row.items() if key not in ("prompt", "completion", "completion_ids")}
    kwargs = dict(prompts=[row["prompt"]] * 2, completions=[completion] * 2, completion_ids=[[], []], **extra,
                  trainer_state=trainer.state, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)  # fmt: skip
    for func, name in zip(trainer.reward_funcs, trainer.reward_func_names):
        if not callable(func) or hasattr(func, "forward") or inspect.iscoroutinefunction(func):
            continue  # reward models and async functions: TRL's own path
        try:
            inspect.signature(func).bind(**kwargs)
        except TypeError as err:
            raise RewardFunctionError(
                f"reward function {name!r} cannot take TRL's arguments ({err}): TRL calls it with prompts=, "
                f"completions=, completion_ids=, trainer_state=, log_extra=, log_metric= and every other dataset "
                f"column ({', '.join(extra) or 'none'}). Add **kwargs to its signature."
            ) from None
        except ValueError:  # no signature (a builtin): nothing to check
            continue
        try:
            output = func(**kwargs)
        except Exception:  # noqa: BLE001 - the made-up completion may be what it cannot score; the real run will tell
            continue
        problem = reward_output_problem(output, 2)
        if problem is not None:
            raise RewardFunctionError(
                f"reward function {name!r} {problem} (dry call on train_dataset row 0 with two completions). A reward "
                "function returns a list with one float (or None: unscorable) per completion."
            )


def checked_reward_functions(funcs: list, names: list[str]) -> list:
    """TRL's reward functions with every plain (synchronous, non-model) one wrapped so that what it returns at each
    rollout is checked: a value TRL cannot turn into one reward per completion (a string, one float, a list of
    lists, n − 1 values) raises a [`RewardFunctionError`] naming the function, what it returned and `n`, instead of
    TRL's `torch.tensor` error mid-step."""
    return [f if not callable(f) or hasattr(f, "forward") or inspect.iscoroutinefunction(f) else _checked(f, name)
            for f, name in zip(funcs, names)]  # fmt: skip


def _checked(func, name: str):
    @functools.wraps(func)
    def checked(*args, **kwargs):
        output = func(*args, **kwargs)
        expected = len(kwargs.get("completions") or [])
        problem = reward_output_problem(output, expected)
        if problem is not None:
            raise RewardFunctionError(
                f"reward function {name!r} {problem} (a rollout of {expected} completions). A reward function returns "
                f"a list with one float (or None: unscorable) per completion, e.g. [1.0, 0.0, ...] of length {expected}."
            )
        return output

    return checked


def reward_output_problem(output, expected: int) -> str | None:
    if isinstance(output, (str, bytes, dict)) or not hasattr(output, "__len__") or not hasattr(output, "__iter__"):
        return f"returned {type(output).__name__} {output!r:.40}, not a list"
    values = list(output)
    if len(values) != expected:
        return f"returned {len(values)} values for {expected} completions"
    for value in values:
        if value is None:
            continue
        if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real) and not _is_scalar(value):
            return f"returned a {type(value).__name__} ({value!r:.40}) among its values, not a number"
    return None


def _is_scalar(value) -> bool:
    return getattr(value, "ndim", None) == 0 or getattr(value, "shape", None) == ()


# ---------------------------------------------------------------------------------------------------- tokenizer


def check_vocabulary(tokenizer, model) -> None:
    """Every id the tokenizer can produce indexes the model's input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    if rows is None or tokenizer is None:
        return
    size = len(tokenizer)
    if size > rows:
        raise ModelMismatchError(
            f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: ids >= {rows} would index "
            "past it. Use the tokenizer saved with the model (processing_class=None loads it), or resize the model "
            "with model.resize_token_embeddings(len(tokenizer)) before training."
        )


# ---------------------------------------------------------------------------------------------------- model folders

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class ModelFolderError(ValueError):
    """A local model folder that cannot load: config JSON invalid, no weights, a truncated weights file."""


def check_model_folder(path: str) -> None:
    """A local model (or LoRA adapter) folder: its config JSON parses, it holds weights, and every safetensors file's
    header parses and its tensors end where the file ends (read cheaply, nothing loaded)."""
    import json

    from .state import safetensors_problem

    names = set(os.listdir(path))
    configs = [name for name in ("config.json", "adapter_config.json") if name in names]
    if not configs:
        raise ModelFolderError(
            f"model {path}: no config.json (nor adapter_config.json); point to the folder save_pretrained wrote."
        )
    for name in configs:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                json.load(f)
        except ValueError as err:
            message = f"model {path}: {name} is not valid JSON ({err}); restore it from the original."
            raise ModelFolderError(message) from None
    weights = sorted(name for name in names if name.endswith(_WEIGHT_SUFFIXES) and not name.startswith("training"))
    if not weights and not any(name.endswith(".index.json") for name in names):
        raise ModelFolderError(
            f"model {path}: no weights (no *.safetensors or *.bin); copy the model's weight files into it."
        )
    for name in weights:
        problem = safetensors_problem(os.path.join(path, name)) if name.endswith(".safetensors") else None
        if problem is not None:
            raise ModelFolderError(f"model {path}: {name} {problem}; copy or download it again.")


def check_model_path(name_or_path: str | None) -> str:
    """Fail early, naming the path, when the model is neither a local directory nor a possible Hub id; an embedded
    model's name (`tiny`, `tiny-block`) becomes its path."""
    from ..models.embedded import EMBEDDED_MODELS, resolve_model_name
    from ..models.loading import HUB_ID

    if not name_or_path:
        raise UsageError("model_name_or_path is not set: pass --model_name_or_path or set it in the recipe")
    path = os.path.expanduser(resolve_model_name(name_or_path))  # "tiny", "tiny-block": built on first use
    if os.path.isdir(path):
        check_model_folder(path)  # config JSON, weights present, safetensors headers whole
        return path
    check_offline_name("model_name_or_path", name_or_path, tuple(EMBEDDED_MODELS))
    if os.path.exists(path):
        raise UsageError(f"model_name_or_path: {name_or_path} is a file, not a model directory")
    if not HUB_ID.match(name_or_path):
        raise UsageError(f"model_name_or_path: no such directory: {name_or_path}")
    return name_or_path
