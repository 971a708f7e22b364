"""The registry of model families: one module each, one line each in :data:`FAMILIES`.

A family module declares ``FAMILY`` (:class:`~trl_dllm.models.specs.Family`): its specs by ``model_type``,
``architectures`` and ``dllm_family`` marker, its native layout (class and config translation) and its tiny-checkpoint
facts, with its special ids written once. Every table the library reads is derived here from :data:`FAMILIES`; family
names are listed nowhere else. Modules whose names start with ``_`` hold what several families share (:mod:`._moe`
for LLaDA2 and LLaDA-MoE, :mod:`._qwen` for Dream and SDAR). Adding a family: docs/models.md#adding-a-family.
A family defined outside the package (a user's, a test's) joins the tables with :func:`register_family` and leaves them
with :func:`unregister_family`.
"""

from __future__ import annotations

from ..native import NativeLayout
from ..specs import Family, ModelSpec, TinyCheckpoint
from . import diffusion_gemma, dream, generic, llada, llada2, llada_moe, sdar

FAMILIES: tuple[Family, ...] = (
    llada.FAMILY,
    dream.FAMILY,
    sdar.FAMILY,
    llada_moe.FAMILY,
    llada2.FAMILY,
    diffusion_gemma.FAMILY,
    generic.FAMILY,
)
_PACKAGE_FAMILIES = len(FAMILIES)  # the package's own; register_family appends after them

MODEL_SPECS: dict[str, ModelSpec] = {}
"""Specs of the families' own (remote-code) checkpoints, by ``config.model_type``."""
ARCHITECTURE_SPECS: dict[str, ModelSpec] = {}
"""Specs by ``config.architectures`` name, for families whose ``config.json`` shares another family's ``model_type``;
looked up first."""
MARKED_SPECS: dict[str, ModelSpec] = {}
"""Specs by the ``config.dllm_family`` marker (natively loaded families, and ``"block"``)."""
NATIVE_LAYOUTS: dict[str, NativeLayout] = {}
"""How each family's original checkpoint loads into its native class, by layout name."""
TINY_CHECKPOINTS: dict[str, TinyCheckpoint] = {}
"""What each family's tiny original-layout checkpoint is made of (:mod:`trl_dllm.models.tiny_families`)."""
RELEASED_IDS: dict[str, str] = {}
"""The family of each Hub id whose ``config.json`` is its family's released config
(:func:`trl_dllm.models.tiny_families.released_original_config`), planned without the Hub."""
RELEASED_CONFIGS: dict[str, dict] = {}
"""Released checkpoints' ``config.json`` by Hub id, embedded: ``trl-dllm plan`` plans them without the Hub."""
MODEL_CLASSES: dict[str, object] = {}
"""``model_class()`` by ``config.model_type``, for the families ``AutoModelForCausalLM`` does not build
(:attr:`~trl_dllm.models.specs.Family.model_class`)."""


def _derive() -> None:
    """Fill the tables above from :data:`FAMILIES`, in place (modules that imported a table see the change)."""
    tables = (
        (MODEL_SPECS, {k: spec for family in FAMILIES for k, spec in family.model_types.items()}),
        (ARCHITECTURE_SPECS, {k: spec for family in FAMILIES for k, spec in family.architectures.items()}),
        (MARKED_SPECS, {k: spec for family in FAMILIES for k, spec in family.markers.items()}),
        (NATIVE_LAYOUTS, {f.layout.name: f.layout for f in FAMILIES if f.layout is not None}),
        (TINY_CHECKPOINTS, {f.name: f.tiny for f in FAMILIES if f.tiny is not None}),
        (RELEASED_IDS, {i: f.name for f in FAMILIES if f.tiny is not None for i in f.tiny.released_ids}),
        (RELEASED_CONFIGS, {k: dict(c) for family in FAMILIES for k, c in family.released_configs.items()}),
        (MODEL_CLASSES, {k: f.model_class for f in FAMILIES if f.model_class for k in f.model_types}),
    )
    for table, content in tables:
        table.clear()
        table.update(content)
    for layout in NATIVE_LAYOUTS.values():  # so a native model saves in its original layout however it was built
        layout.register_conversion()


_derive()


def register_family(family: Family) -> None:
    """Add ``family`` (a :class:`~trl_dllm.models.specs.Family` defined outside this package: a user's, a test's) to
    :data:`FAMILIES` and to every table derived from it, as its line in :data:`FAMILIES` would; its specs' kinds come
    with them (a new :class:`~trl_dllm.models.specs.Kind` needs no registration of its own). Call it before the model
    is resolved (``resolve_model_spec``, the trainer, ``trl_dllm.generate``, ``trl-dllm plan``); undo it with
    :func:`unregister_family`. A family of the package is a module of this package and a line of :data:`FAMILIES`.

    Raises:
        ValueError: a family of that name is registered, or one of its keys (``model_type``, architecture, marker,
            layout name, released id) is another family's.
    """
    global FAMILIES
    if any(f.name == family.name for f in FAMILIES):
        raise ValueError(f"family {family.name!r} is already registered: unregister_family({family.name!r}) first.")
    claimed = {
        "model_type": (family.model_types, MODEL_SPECS),
        "architecture": (family.architectures, ARCHITECTURE_SPECS),
        "dllm_family marker": (family.markers, MARKED_SPECS),
        "released config": (family.released_configs, RELEASED_CONFIGS),
        "layout": ((family.layout.name,) if family.layout is not None else (), NATIVE_LAYOUTS),
        "released id": (family.tiny.released_ids if family.tiny is not None else (), RELEASED_IDS),
    }
    for what, (keys, table) in claimed.items():
        if taken := sorted(set(keys) & set(table)):
            raise ValueError(f"family {family.name!r}: {what} {taken} belongs to a registered family; pick another.")
    FAMILIES = (*FAMILIES, family)
    _derive()


def unregister_family(name: str) -> None:
    """Remove the family named ``name`` that :func:`register_family` added, and its keys from the derived tables.

    Raises:
        ValueError: no family of that name was added by :func:`register_family` (the package's own stay).
    """
    global FAMILIES
    if name not in {f.name for f in FAMILIES[_PACKAGE_FAMILIES:]}:
        raise ValueError(f"family {name!r} was not added by register_family; registered: "
                         f"{[f.name for f in FAMILIES[_PACKAGE_FAMILIES:]]}.")  # fmt: skip
    FAMILIES = tuple(f for f in FAMILIES if f.name != name)
    _derive()


def training_refusal(config, estimator: str, loss_type: str, *, estimator_defaulted: bool = False,
                     name: str | None = None) -> str | None:
    """The message refusing a run the trainer cannot do with a model of ``config`` (a ``config.json`` dict read
    without the weights, a config, or a model object), asked for ``estimator`` (fitted to the family when
    ``estimator_defaulted``) and ``loss_type``, from the first family whose ``training_refusal`` refuses it, else
    `None`. ``name``: the checkpoint, for the message. Called before the weights are loaded, by the trainer
    (`training.model_loading`) and ``trl-dllm plan``."""
    refusals = (family.training_refusal(config, estimator, loss_type, estimator_defaulted=estimator_defaulted,
                                        name=name) for family in FAMILIES if family.training_refusal)  # fmt: skip
    return next((refusal for refusal in refusals if refusal is not None), None)


def native_layout(config_dict: dict) -> NativeLayout | None:
    """The :class:`NativeLayout` of an original ``config.json`` dict, by its ``architectures`` where a layout claims
    them, else by its ``model_type``; `None` if unknown."""
    architectures = set(config_dict.get("architectures") or ())
    claimed = next((layout for layout in NATIVE_LAYOUTS.values() if architectures & set(layout.architectures)), None)
    if claimed is not None:
        return claimed
    model_type = config_dict.get("model_type")
    return next((layout for layout in NATIVE_LAYOUTS.values() if model_type in layout.model_types), None)


def native_config(config_dict: dict, source: str | None = None):
    """Translate an original ``config.json`` dict into the native config, marked for
    :func:`~trl_dllm.models.resolve_model_spec`.

    Args:
        config_dict (`dict`): the checkpoint's ``config.json``.
        source (`str`, *optional*): where it was loaded from (Hub id or folder), kept to point the saved ``auto_map``
            at the family's code.
    """
    layout = native_layout(config_dict)
    if layout is None:
        raise ValueError(f"model_type={config_dict.get('model_type')!r} has no native layout.")
    config = layout.translate(config_dict)
    config.dllm_family = layout.marker
    mask = config_dict.get("mask_token_id", layout.mask_token_id)
    if mask is not None:
        config.mask_token_id = int(mask)
    config.dllm_original_config = dict(config_dict)
    config.dllm_source = source
    config.architectures = [layout.model_class.__name__]
    layout.register_conversion()
    return config
