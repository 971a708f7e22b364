"""The option spec of a method: one declaration per option, in the method's registry entry.

An estimator or objective takes keyword options (``mc_samples``, ``clip_high``, …). Each is declared once, as an
[`Option`], in the module of the method that owns it (options several methods share live in the package's shared
module: ``likelihood/_options.py``, ``objectives/_common.py``), and listed in the method's registry entry. Everything
else is derived from these declarations:

- the fields of ``DiffusionGRPOConfig`` that only methods read (``mc_samples``, ``stabledrl_clip_high``, …): their
  type, default, ``--help`` and docstring paragraph (``trl_dllm.config``);
- which config field the trainer reads each option from (``trl_dllm.training.scoring``);
- the per-value checks at construction, with the message naming the field, the value and the fix
  (``trl_dllm.config_checks``).

An option has one of three sources:

- a field it **declares** (``default`` given): the config gains a field named ``field`` with that default;
- a field declared **elsewhere** (``default`` not given, ``field`` set): TRL's own (``temperature``, ``beta``,
  ``epsilon``) or a general field of the config (``mc_checkpointing``, ``cfg_scale``);
- **the run** (``field=None``): set by the trainer from the model and the run (``block_length`` of a block-diffusion
  family, ``entropy_grad``), or left at the function's default — ``source`` says which.

This module imports nothing from the trainer or TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["NOT_DECLARED", "Option", "at_least", "between", "greater_than", "one_of", "option_sources"]


class _NotDeclared:
    def __repr__(self) -> str:
        return "NOT_DECLARED"


NOT_DECLARED = _NotDeclared()
"""The ``default`` of an option whose config field is declared elsewhere (TRL's, or a general field), or that no
field sets."""

Check = Callable[[object], "str | None"]
"""A per-value check: what is wrong with the value (``"must be >= 1"``), or ``None`` when it is valid."""


@dataclass(frozen=True)
class Option:
    """One keyword option of an estimator or objective.

    Args:
        keyword (`str`): the method function's keyword (``"clip_high"``).
        field (`str` or `None`, *optional*, defaults to `None`): the ``DiffusionGRPOConfig`` field it is read from
            (``"stabledrl_clip_high"``); ``None`` when no field sets it (the run does, or the function's default
            stands: see ``source``).
        default (*optional*): the default of the field this option declares. Not given (`NOT_DECLARED`): the field is
            declared elsewhere (TRL's ``GRPOConfig``, or a general field of the config), or there is none.
        type (`str`, *optional*, defaults to `""`): the declared field's annotation (``"int"``, ``"float | None"``).
        help (`str`, *optional*, defaults to `""`): the declared field's one-line ``--help``.
        doc (`str`, *optional*, defaults to `""`): the declared field's paragraph in the config's docstring.
        check (`Callable[[object], str | None]`, *optional*): what is wrong with a value (``"must be >= 1"``), or
            ``None`` when it is valid; run on the field's value at construction. ``None`` in the field (an optional
            field left unset) is not checked.
        hint (`str`, *optional*, defaults to `""`): what to set instead, appended to a failed check's message
            (``"SPG and StableDRL use 1.5"``).
        source (`str`, *optional*, defaults to `""`): with ``field=None``: where the value comes from (``"the model's
            own block size on a block-diffusion model"``, ``"the function's default, 0.2"``).
        section (`str`, *optional*, defaults to `"estimation"`): the docstring section of a declared field,
            ``"estimation"`` or ``"objective"``.
    """

    keyword: str
    field: str | None = None
    default: object = NOT_DECLARED
    type: str = ""
    help: str = ""
    doc: str = ""
    check: Check | None = None
    hint: str = ""
    source: str = ""
    section: str = "estimation"

    def __post_init__(self):
        if self.declares_field and not (self.field and self.type and self.help and self.doc):
            raise ValueError(f"Option {self.keyword!r} declares a config field: it needs field, type, help and doc.")
        if self.field is None and not self.source:
            raise ValueError(f"Option {self.keyword!r} is set by no field: say where it comes from in source.")

    @property
    def declares_field(self) -> bool:
        """The config gains a field for this option (its ``default`` is given)."""
        return self.default is not NOT_DECLARED

    def problem(self, value) -> str | None:
        """The error message for ``value`` of the field (naming field, value and fix), or ``None`` when it passes."""
        if self.check is None or value is None:
            return None
        wrong = self.check(value)
        if wrong is None:
            return None
        hint = f" ({self.hint})" if self.hint else ""
        return f"{self.field}={value!r} {wrong}{hint}."


def at_least(bound: float) -> Check:
    """Valid when ``value >= bound``."""
    return lambda value: None if value >= bound else f"must be >= {bound:g}"


def greater_than(bound: float) -> Check:
    """Valid when ``value > bound``."""
    return lambda value: None if value > bound else f"must be > {bound:g}"


def between(low: float, high: float, *, closed_high: bool = True) -> Check:
    """Valid in ``[low, high]`` (``[low, high)`` with ``closed_high=False``)."""
    text = f"must be in [{low:g}, {high:g}{']' if closed_high else ')'}"
    return lambda value: None if low <= value <= high and (closed_high or value < high) else text


def one_of(choices: Sequence) -> Check:
    """Valid when the value is one of ``choices``."""
    return lambda value: None if value in choices else f"is not one of {list(choices)}"


def option_sources(entries: Iterable) -> dict[str, Option]:
    """Every option the registry ``entries`` declare, by keyword, once. Two methods that take the same keyword share
    one declaration (the same [`Option`] object, or equal ones); two different declarations of a keyword are an error
    (the trainer reads one value per keyword)."""
    found: dict[str, Option] = {}
    for entry in entries:
        for option in entry.options:
            known = found.setdefault(option.keyword, option)
            if known != option:
                raise ValueError(f"Option {option.keyword!r} is declared twice, differently: {known} and {option}.")
    return found
