"""A model's shape for the memory planner, read from its configuration alone (weights on the meta device).

:func:`read_architecture` takes a local folder or a Hub id, reads its ``config.json`` (only that file is fetched,
never weights), translates a known dLLM family's original config with :func:`trl_dllm.models.families.native_config`
(LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE) or any other transformers config with ``AutoConfig``, builds the model on
``torch.device("meta")`` (no memory, no weights) and counts its parameters and linear layers from the module tree:
the numbers are the real model's, experts included (an MoE holds every expert; a token runs ``top_k`` of them).
The released ``config.json`` of a few Hub ids is embedded (:func:`embedded_config`): those plan without the Hub.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Architecture", "Linear", "architecture_from_config", "embedded_config", "read_architecture", "read_model"]


@dataclass(frozen=True)
class Linear:
    """Linear layers of one kind: ``count`` modules named ``name`` (the last part of the module path) of shape
    ``in_features → out_features``; ``per_token`` is the fraction of tokens that pass through one of them (1, or
    ``top_k / num_experts`` for a routed expert); ``path`` is the full module path of the first of them (what PEFT
    matches a regex ``target_modules`` against): modules of one name in different places (an encoder's and a
    decoder's ``q_proj``) are kinds of their own. ``parameter``: one expert's slice of a stacked 3-D expert parameter
    (``mlp.experts.gate_up_proj``; ``count`` experts over all layers), which PEFT adapts through ``target_parameters``
    only (rank ``r`` per expert, the adapted weight materialised in each forward)."""

    name: str
    in_features: int
    out_features: int
    count: int
    per_token: float = 1.0
    path: str = ""
    parameter: bool = False


@dataclass(frozen=True)
class Architecture:
    """What the planner's formulas read from a model.

    Args:
        family (`str`): the dLLM family (`"llada"`, `"dream"`, `"sdar"`, `"llada2"`, `"llada_moe"`) or the config's
            ``model_type``.
        hidden, layers, heads, kv_heads, head_dim, intermediate, vocab (`int`): the transformer's sizes
            (``intermediate``: the dense MLP width).
        parameters (`int`): parameters held (every expert of an MoE).
        active_parameters (`int`): parameters one token runs through (``top_k`` experts per MoE layer).
        linears (`tuple[Linear, ...]`): the linear layers inside the decoder layers (what LoRA can target).
        head_parameters (`int`): parameters of the LM head (also in ``parameters``).
        moe_layers (`int`): layers whose MLP is routed; experts, top_k, expert_intermediate and shared_intermediate
            (width of the always-on shared expert(s), 0 if none) describe it.
        qk_norm (`bool`): RMSNorm on queries and keys (Qwen3 / SDAR, LLaDA2, LLaDA-MoE).
        block_causal (`bool`): its family's kind is block-causal (``Kind.block_causal``: SDAR, LLaDA2; the family
            resolved from the config as loading resolves it, ``trl_dllm.models.config_family_spec``): rollouts keep an
            exact KV cache.
        canvas_length (`int`): an encoder-decoder block-diffusion model (DiffusionGemma): its decoder's block; 0
            for every decoder-only model. Its passes are planned by :mod:`trl_dllm.planning.encoder_decoder`.
        attention (`tuple[tuple[int, int, bool], ...]`): per text layer of an encoder-decoder model, the query width
            (heads × head dim), the key/value width and whether it is a sliding-window layer (its layers differ).
        sliding_window (`int`): the sliding-window layers' window (0: none).
    """

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    parameters: int
    active_parameters: int
    head_parameters: int = 0
    linears: tuple[Linear, ...] = field(default=(), repr=False)
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    qk_norm: bool = False
    block_causal: bool = False
    canvas_length: int = 0
    attention: tuple[tuple[int, int, bool], ...] = field(default=(), repr=False)
    sliding_window: int = 0

    def lora_targets(self, targets, parameters=None) -> tuple[Linear, ...]:
        """The linear layers LoRA wraps for ``targets``: a list of module names, ``"all-linear"``, or a regex string
        (PEFT matches it against the full module path; here against the last part or the full path, which a
        ``.*name`` pattern matches alike); a list entry matches as PEFT matches it: the full path, or its end after a
        dot (``shared_experts.gate_proj`` the shared expert's and not the dense layer's ``gate_proj``). ``parameters``
        names stacked expert parameters (PEFT's ``target_parameters``: a parameter's full name or a suffix of it). The
        LM head is never counted among the decoder linears."""
        import re

        modules = tuple(lin for lin in self.linears if not lin.parameter)
        stacked = tuple(lin for lin in self.linears if lin.parameter and any(
            lin.path == p or lin.path.endswith("." + p) for p in parameters or ()))  # fmt: skip
        if targets is None:
            return stacked
        if isinstance(targets, str):
            if targets == "all-linear":
                return modules + stacked
            return tuple(lin for lin in modules if re.fullmatch(targets, lin.name)
                         or (lin.path and re.fullmatch(targets, lin.path))) + stacked  # fmt: skip
        names = set(targets)
        suffixes = tuple(f".{name}" for name in names)
        return tuple(
            lin for lin in modules if lin.name in names or lin.path in names or lin.path.endswith(suffixes)
        ) + stacked


def _first(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _build_on_meta(config, model_class):
    """The model of ``config`` on the meta device, its tied weights tied (as ``from_pretrained`` ties them)."""
    import torch
    from transformers.initialization import no_init_weights

    from ..models.families import MODEL_CLASSES

    own = MODEL_CLASSES.get(getattr(config, "model_type", None))  # a family AutoModelForCausalLM does not build
    model_class = model_class or (own() if own is not None else None)
    with torch.device("meta"), no_init_weights():  # nothing to initialise: only shapes are read
        if model_class is not None:
            model = model_class(config)
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # DiffusionGemma's encoder and decoder share their text weights; tied embeddings
    return model


def _experts(module):
    """``(number of experts, parameters of one expert)`` of an MoE block's ``experts``: a list of expert modules, or
    one module holding them fused (``num_experts`` 3-D parameters); `None` for anything else."""
    from torch import nn

    routed = getattr(module, "experts", None)
    if isinstance(routed, nn.ModuleList) and len(routed):
        return len(routed), sum(p.numel() for p in routed[0].parameters())
    if isinstance(routed, nn.Module) and isinstance(getattr(routed, "num_experts", None), int):
        return routed.num_experts, sum(p.numel() for p in routed.parameters()) // routed.num_experts
    return None


def architecture_from_config(config, family: str | None = None, model_class=None) -> Architecture:
    """The :class:`Architecture` of a transformers ``config``: the model is built on the meta device (no memory) from
    ``model_class`` (default: the family's own class where it declares one, ``Family.model_class``: DiffusionGemma's;
    else ``AutoModelForCausalLM``) and its modules
    counted, each parameter once (tied ones are one). Whether it is block-causal is asked of the kind of the family its
    config resolves to (``trl_dllm.models.config_family_spec``: by architecture, ``model_type`` or marker), never of
    ``family``, a name for messages."""
    import re

    from torch import nn

    from ..models import config_family_spec

    spec = config_family_spec(config)  # what its kind can do, asked of the family the config resolves to
    model = _build_on_meta(config, model_class)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    head_parameters = head.weight.numel() if head is not None else 0
    top_k = int(_first(text, "num_experts_per_tok", "top_k", "top_k_experts", default=0) or 0)
    kinds, paths, moe_layers, experts, inactive, counted = Counter(), {}, 0, 0, 0, set()
    for name, module in model.named_modules():
        routed = _experts(module)
        if routed is not None and id(next(module.experts.parameters())) not in counted:  # a tied copy counts once
            counted.add(id(next(module.experts.parameters())))
            moe_layers += 1
            experts, per_expert = routed
            top_k = top_k or experts
            inactive += (experts - top_k) * per_expert
            for key, stack in module.experts.named_parameters(recurse=False):  # stacked experts: (E, out, in)
                if stack.dim() == 3:
                    dims = tuple(int(d) for d in stack.shape[1:])
                    in_f, out_f = dims if getattr(module.experts, "is_transposed", False) else dims[::-1]
                    path = f"{name}.experts.{key}"
                    kind = (key, in_f, out_f, top_k / experts, re.sub(r"\d+", "N", path), True)
                    kinds[kind] += experts
                    paths.setdefault(kind, path)
        if isinstance(module, nn.Linear) and module is not head and ".layers." in f".{name}" and "vision" not in name:
            expert = ".experts." in f".{name}"
            share = (top_k / experts) if expert and experts else 1.0
            key = (name.rsplit(".", 1)[-1], module.in_features, module.out_features, share, re.sub(r"\d+", "N", name),
                   False)  # fmt: skip
            kinds[key] += 1
            paths.setdefault(key, name)
    linears = tuple(Linear(n, i, o, c, s, paths[(n, i, o, s, t, p)], p)
                    for (n, i, o, s, t, p), c in sorted(kinds.items()))  # fmt: skip
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    expert_intermediate = int(_first(text, "moe_intermediate_size", "expert_intermediate_size", default=0))
    shared = int(_first(text, "num_shared_experts", default=0)) * expert_intermediate
    shared = shared or int(_first(text, "shared_expert_intermediate_size", default=0) or 0)
    canvas = int(getattr(config, "canvas_length", 0) or 0)
    attention = ()
    kv_heads = head_dim = None
    if canvas:  # encoder-decoder (DiffusionGemma): each decoder layer's attention widths (they differ by layer type)
        attention = tuple((layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
                           bool(layer.self_attn.is_sliding)) for layer in model.model.decoder.layers)  # fmt: skip
        first = model.model.decoder.layers[0].self_attn  # the config's own sizes vary by layer: the first layer's
        kv_heads, head_dim = first.k_proj.out_features // first.head_dim, first.head_dim
    return Architecture(
        family=family or getattr(config, "model_type", "unknown"),
        hidden=hidden,
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=int(kv_heads or _first(text, "num_key_value_heads", default=heads)),
        head_dim=int(head_dim or _first(text, "head_dim", default=hidden // heads)),
        intermediate=int(_first(text, "intermediate_size", "dense_intermediate_size", default=4 * hidden)),
        vocab=int(text.vocab_size),
        parameters=parameters,
        active_parameters=parameters - inactive,
        head_parameters=head_parameters,
        linears=linears,
        moe_layers=moe_layers,
        experts=experts if moe_layers else 0,
        top_k=top_k if moe_layers else 0,
        expert_intermediate=expert_intermediate if moe_layers else 0,
        shared_intermediate=shared if moe_layers else 0,
        qk_norm=any(n.endswith(("q_norm", "query_layernorm", "q_layernorm")) for n, _ in model.named_modules()),
        block_causal=bool(spec is not None and spec.kind.block_causal),
        canvas_length=canvas,
        attention=attention,
        sliding_window=int(getattr(text, "sliding_window", 0) or 0) if canvas else 0,
    )


def embedded_config(name_or_path: str, revision: str | None = None) -> dict | None:
    """The released ``config.json`` embedded for the Hub id ``name_or_path``
    (:data:`trl_dllm.models.families.RELEASED_CONFIGS`: LLaDA2.0 / 2.1 mini and flash; and the ids of
    :data:`~trl_dllm.models.families.RELEASED_IDS`: each family's released config), or `None`: a local path of
    that name, another revision than ``main`` or an id without an embedded config are read as they are."""
    from ..models.families import RELEASED_CONFIGS, RELEASED_IDS
    from ..models.tiny_families import released_original_config

    if os.path.exists(os.path.expanduser(name_or_path)) or revision not in (None, "main"):
        return None
    config = RELEASED_CONFIGS.get(name_or_path)
    if config is None and name_or_path in RELEASED_IDS:
        config = released_original_config(RELEASED_IDS[name_or_path])
    return dict(config) if config is not None else None


def read_architecture(name_or_path: str, **hub_kwargs) -> Architecture:
    """The :class:`Architecture` of a local model folder or a Hub id, from its ``config.json`` alone (:func:`read_model`
    without the spec)."""
    return read_model(name_or_path, **hub_kwargs)[0]


def read_model(name_or_path: str, **hub_kwargs):
    """The :class:`Architecture` of a local model folder or a Hub id, from its ``config.json`` alone, and the family
    spec (``ModelSpec``, `None`: generic) its config resolves to as loading resolves it
    (``trl_dllm.models.config_family_spec``: by architecture, ``model_type`` or ``dllm_family`` marker, on the config
    the model is built from: a known family's native one, else the checkpoint's own); ``trl-dllm plan`` asks that
    spec's kind what the run does (its estimator, its block size, its sampler). A Hub id whose released
    ``config.json`` is embedded (:func:`embedded_config`) is read from it, without the Hub.

    Raises:
        `FileNotFoundError`: ``name_or_path`` is a folder without ``config.json``.
        `OSError`: a Hub id whose configuration cannot be fetched (no network, unknown repository); the message names
            the fix (a local folder holding only its ``config.json``).
    """
    from ..models.families import native_config, native_layout
    from ..models.loading import HUB_ID
    from ..models.native import read_config_dict

    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        adapter = os.path.join(path, "adapter_config.json")
        if os.path.isfile(adapter):  # an adapter folder: its base holds the architecture
            with open(adapter) as f:
                base = json.load(f).get("base_model_name_or_path")
            raise FileNotFoundError(
                f"model_name_or_path: {name_or_path} is a LoRA adapter (adapter_config.json, no config.json): plan its "
                f"base model instead, --model_name_or_path {base or '<its base model>'} with --use_peft true and the "
                "adapter's lora_r / lora_target_modules"
            )
        raise FileNotFoundError(f"model_name_or_path: {name_or_path} has no config.json")
    if not os.path.exists(path) and not HUB_ID.match(name_or_path):
        raise FileNotFoundError(f"model_name_or_path: no such directory: {name_or_path}")
    original = embedded_config(name_or_path, hub_kwargs.get("revision"))
    try:
        original = original or read_config_dict(path if os.path.isdir(path) else name_or_path, **hub_kwargs)
    except OSError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise OSError(
            f"model_name_or_path: cannot read the configuration of {name_or_path!r} ({first}). The planner needs "
            f"only its config.json: run where the Hub is reachable (`hf download {name_or_path} config.json`), or pass "
            "--model_name_or_path <a folder holding that config.json>."
        ) from None
    from ..models import config_family_spec

    layout = native_layout(original)
    if layout is not None:
        config = native_config(original)
        arch = architecture_from_config(config, family=layout.name, model_class=layout.model_class)
        return arch, config_family_spec(config)
    from transformers import AutoConfig

    config_dict = {k: v for k, v in original.items() if k not in ("auto_map", "architectures")}
    config = AutoConfig.for_model(**config_dict)
    config.architectures = original.get("architectures")  # read by the family's resolution, as a loaded model's
    return architecture_from_config(config), config_family_spec(config)
