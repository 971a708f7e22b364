"""The configuration fields and docstring entries derived from the registries: each estimator's, objective's and
sampler schedule's `Option` gives its field's type, default, ``--help`` and ``Parameters:`` entry
(`trl_dllm.core.methods.declared_fields`). Used by `DiffusionGRPOConfig` and `DiffusionDPOConfig`."""

from __future__ import annotations

import textwrap
from dataclasses import field, make_dataclass

from .core.likelihood import ESTIMATORS
from .core.methods import declared_fields, methods_taking
from .core.objectives import OBJECTIVES
from .core.options import Option
from .core.sampling.schedules import SAMPLER_OPTIONS


def _filled(option: Option, text: str, *, doc: bool) -> str:
    """An option's help or doc with ``{estimators}`` / ``{objectives}`` replaced by the methods that declare it."""
    estimators, objectives = methods_taking(option.keyword)
    if not doc:
        return text.replace("{estimators}", ", ".join(estimators)).replace("{objectives}", ", ".join(objectives))
    quoted = [f'`"{name}"`' for name in estimators]
    losses = [f'`loss_type="{objectives[0]}"`', *(f'`"{name}"`' for name in objectives[1:])] if objectives else []

    def join(names):
        return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)

    return text.replace("{estimators}", join(quoted)).replace("{objectives}", join(losses))


def method_option_fields(options: list[Option], name: str, doc: str):
    """A dataclass holding the config fields that ``options`` declare (registry options,
    `trl_dllm.core.methods.declared_fields`): each one's type, default and ``--help`` come from its
    [`~trl_dllm.core.options.Option`]. `DiffusionGRPOConfig` takes every declared option, `DiffusionDPOConfig` those of
    the estimators it can use."""
    specs = [
        (option.field, option.type, field(default=option.default,
                                          metadata={"help": _filled(option, option.help, doc=False)}))
        for option in options
    ]  # fmt: skip
    fields_class = make_dataclass(name, specs)
    fields_class.__module__ = __name__  # its string annotations resolve in this module (HfArgumentParser)
    fields_class.__doc__ = doc
    return fields_class


MethodOptionFields = method_option_fields(
    declared_fields(), "MethodOptionFields",
    "The configuration fields the estimators and objectives declare (`DiffusionGRPOConfig`).",
)  # fmt: skip

SamplerOptionFields = method_option_fields(
    list(SAMPLER_OPTIONS), "SamplerOptionFields", "The decoding fields of the samplers' schedules (EOSER, ASS)."
)


def parameter_doc(name: str, annotation: str, default, text: str) -> str:
    """One ``Parameters:`` entry of the docstring, in the format of TRL's configuration classes."""
    kind = " or ".join(f"`{part.strip()}`" for part in annotation.split("|"))
    shown = f'"{default}"' if isinstance(default, str) else default
    body = textwrap.fill(text, width=120, initial_indent=" " * 12, subsequent_indent=" " * 12)
    return f"        {name} ({kind}, *optional*, defaults to `{shown}`):\n{body}"


def _estimator_doc() -> str:
    listed = ", ".join(f'`"{name}"` ({entry.summary})' for name, entry in ESTIMATORS.items())
    own = "; ".join(f'`{name}`: `"{entry.estimators[0]}"`' for name, entry in OBJECTIVES.items())
    text = (
        f"Sequence log-likelihood estimator: {listed}. See `docs/estimators.md`. `None` picks the loss type's own: "
        f"the first estimator its registry entry lists ({own}), `\"elbo\"` for TRL's loss types; and on a "
        "block-diffusion model (SDAR, TraDo, LLaDA2) the family's own, `\"block\"`, unless that estimator is "
        "block-causal already or the loss type cannot use `\"block\"`. The trainer's start-up line says which it "
        "picked. A value you set is kept and checked."
    )
    return parameter_doc("estimator", "str | None", None, text).lstrip()


def options_doc(options: list[Option]) -> str:
    """The ``Parameters:`` entries of the fields ``options`` declare, in TRL's docstring format."""
    return "\n".join(
        parameter_doc(option.field, option.type, option.default, _filled(option, option.doc, doc=True))
        for option in options
    )  # fmt: skip


def _options_doc(section: str) -> str:
    return options_doc([option for option in declared_fields() if option.section == section])


def fill_docstring(cls) -> None:
    """The ``{estimator}`` and ``{..._options}`` placeholders of `cls.__doc__` (`DiffusionGRPOConfig`'s) replaced by
    the entries of the fields the registries declare."""
    for name, text in (("estimator", _estimator_doc()), ("estimation_options", _options_doc("estimation")),
                       ("objective_options", _options_doc("objective")),
                       ("sampler_options", options_doc(list(SAMPLER_OPTIONS)))):
        cls.__doc__ = cls.__doc__.replace("{" + name + "}", text)
