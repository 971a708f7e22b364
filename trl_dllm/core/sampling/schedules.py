"""EOS early rejection (EOSER) and the ascending step-size schedule (ASS) of CJ-GRPO ([arXiv 2509.23924](https://huggingface.co/papers/2509.23924)).

Two decoding options any sampler built on :func:`~trl_dllm.core.sampling.loop.decode_blocks` takes
(:class:`~trl_dllm.core.sampling.options.DecodingOptions` fields; the trainer's config fields of the same names,
declared here as [`~trl_dllm.core.options.Option`]s). Neither changes the distribution a token is sampled from, only
*which* positions a step commits and *how many*: the recorded trajectory (``unmask_step``, ``logprobs``) stays exact,
and the ``trajectory`` estimator replays it as for any rollout.

**EOSER** (``eos_min_gamma = γ_min``, ``eos_max_gamma = γ_max``). At global step ``s`` of ``T = diffusion_steps``, the
confidence of a position whose sampled token is an EOS id is scaled before the positions to commit are chosen:

    c_j ← γ_s · c_j   if x̂_j ∈ eos_token_ids,      γ_s = γ_min + (γ_max − γ_min) · t_s
    t_s = min(s, T − 1) / (T − 1)                  (step_schedule="uniform"; t = 1 when T = 1)
    t_s = (2^(min(s, T − 1) + 1) − 1) / 2^T        (step_schedule="ascending": the share of the canvas committed
                                                    by the end of step s)

so EOS is committed late unless it is very confident early on (γ_min < 1: strong rejection in the first steps, none
by the last). The released code scales LLaDA's ``low_confidence`` (the sampled token's probability); it is refused
with the other confidences (``-H`` and the random or left-to-right orders have no such scale). ``eos_min_gamma=None``
(the default) turns it off, and ``γ_min = γ_max = 1`` leaves every confidence unchanged.

**ASS** (``step_schedule="ascending"``). The ``m`` masked positions of the one decoding block are committed in ``T``
steps of doubling size, the last step taking the rest:

    n_s = min(2^(s+1) − 1, m) − min(2^s − 1, m)        for s < T − 1       (2^s while there are enough)
    n_(T−1) = m − min(2^(T−1) − 1, m)

(``Σ_s n_s = m``; with ``m = 2^T`` that is ``1, 2, 4, …, 2^(T−2), 2^(T−1) + 1``). It needs one block
(``block_length = gen_length``), no threshold decoding, and ``2^(T−1) <= gen_length`` (every step but the last
commits its full ``2^s``); the released code takes ``T = ⌊log2 gen_length⌋``. ``"uniform"`` is the usual
schedule (:func:`~trl_dllm.core.sampling.remasking.transfer_schedule`).

Differences from the released ``eval/generate.py`` and ``cj_grpo_trainer_eoser*.py``: ``s`` is the global step (the
released linear EOSER counts the step inside its block against the total ``T``: the same with one block, as its
training rollouts have); the released ASS also splits the canvas into ``block_num`` blocks of sizes ``2^p`` that
commit the same counts, which is not implemented (one block only); every id of ``eos_token_ids`` is an EOS (the
released code scales the tokenizer's ``eos_token_id`` alone).
"""

from __future__ import annotations

import torch

from ..options import Option, at_least, one_of

__all__ = [
    "EOS_MAX_GAMMA",
    "EOS_MIN_GAMMA",
    "SAMPLER_OPTIONS",
    "STEP_SCHEDULE",
    "STEP_SCHEDULES",
    "ascending_counts",
    "config_problem",
    "eos_gamma",
    "reject_eos",
    "schedule_fields",
    "schedule_problem",
    "step_counts",
]

STEP_SCHEDULES = ("uniform", "ascending")

EOS_MIN_GAMMA = Option(
    "eos_min_gamma", "eos_min_gamma", None, "float | None",
    help="EOSER (CJ-GRPO): scale of EOS's confidence at the first step (rising to eos_max_gamma); None: off.",
    doc="EOS early rejection (CJ-GRPO, EOSER): at the first denoising step the confidence of a sampled EOS is "
    "multiplied by this, rising to `eos_max_gamma` by the last step (linearly, or with the committed share under "
    "`step_schedule=\"ascending\"`), so EOS is committed late. `None` turns it off. Needs `remasking=\"low_confidence\"`. "
    "The released recipes use 0.01. See `docs/generation.md`.",
    check=at_least(0),
)  # fmt: skip
EOS_MAX_GAMMA = Option(
    "eos_max_gamma", "eos_max_gamma", 1.0, "float",
    help="EOSER (CJ-GRPO): scale of EOS's confidence at the last step.",
    doc="EOS early rejection: the scale of a sampled EOS's confidence at the last denoising step (`1.0`: none).",
    check=at_least(0),
)  # fmt: skip
STEP_SCHEDULE = Option(
    "step_schedule", "step_schedule", "uniform", "str",
    help="Tokens committed per step: uniform, or ascending (CJ-GRPO's ASS: 1, 2, 4, ..., the rest).",
    doc="How many tokens each denoising step commits: `\"uniform\"` (the block split evenly over its steps) or "
    "`\"ascending\"` (CJ-GRPO's ASS: `2^s` at step `s`, the last step the rest; one block, no "
    "`confidence_threshold`, `2^(diffusion_steps - 1) <= max_completion_length`). See `docs/generation.md`.",
    check=one_of(STEP_SCHEDULES),
)  # fmt: skip
SAMPLER_OPTIONS = (EOS_MIN_GAMMA, EOS_MAX_GAMMA, STEP_SCHEDULE)
"""The decoding options declared here: `DiffusionGRPOConfig` fields, passed to the sampler by the rollouts."""


def schedule_problem(
    *, gen_length, block_length, diffusion_steps, step_schedule="uniform", eos_min_gamma=None, eos_max_gamma=1.0,
    remasking="low_confidence", confidence_threshold=None, eos_token_ids=(1,), names=None,
) -> str | None:  # fmt: skip
    """What is wrong with these EOSER / ASS settings, naming the field, the value and the fix, or ``None``.

    ``names`` maps ``gen_length`` / ``block_length`` to the caller's field names (the trainer's
    ``max_completion_length``)."""
    names = {"gen_length": "gen_length", "block_length": "block_length", **(names or {})}
    if step_schedule not in STEP_SCHEDULES:
        return f"step_schedule={step_schedule!r} is not one of {list(STEP_SCHEDULES)}."
    for name, value in (("eos_min_gamma", eos_min_gamma), ("eos_max_gamma", eos_max_gamma)):
        if value is not None and value < 0:
            return f"{name}={value} must be >= 0 (a scale of EOS's confidence)."
    if eos_min_gamma is not None:
        if remasking != "low_confidence":
            return (f"eos_min_gamma={eos_min_gamma} (EOS early rejection) scales the low_confidence confidence, a "
                    f"probability; remasking={remasking!r} has no such scale: set remasking='low_confidence' or "
                    "eos_min_gamma=None.")  # fmt: skip
        if not eos_token_ids:
            return f"eos_min_gamma={eos_min_gamma} (EOS early rejection) needs eos_token_ids."
    if step_schedule != "ascending":
        return None
    if confidence_threshold is not None:
        return (f"step_schedule='ascending' fixes the count of every step; confidence_threshold="
                f"{confidence_threshold} decides it by confidence: unset one of them.")  # fmt: skip
    if block_length != gen_length:
        return (f"step_schedule='ascending' decodes the completion as one block: set {names['block_length']}="
                f"{gen_length} (got {names['block_length']}={block_length}).")  # fmt: skip
    if 2 ** (diffusion_steps - 1) > gen_length:
        best = gen_length.bit_length() - 1
        return (f"step_schedule='ascending' commits 2^s tokens at step s: diffusion_steps={diffusion_steps} needs "
                f"{names['gen_length']} >= 2^{diffusion_steps - 1} = {2 ** (diffusion_steps - 1)}, got {gen_length}: "
                f"set diffusion_steps <= {best + 1} (the released code uses floor(log2 {gen_length}) = {best}).")  # fmt: skip
    return None


def ascending_counts(masked: list[int], steps: int) -> list[list[int]]:
    """ASS: ``n[b][s]`` tokens committed at step ``s`` of a block where row ``b`` has ``masked[b]`` masked positions
    (formula in the module docstring); each row's counts sum to its masked count."""
    counts = []
    for m in masked:
        done = [min(2**s - 1, m) for s in range(steps)] + [m]
        counts.append([done[s + 1] - done[s] for s in range(steps)])
    return counts


def step_counts(schedule: str, masked: list[int], steps: int) -> list[list[int]]:
    """The tokens each step of a block commits per row (host integers): ``"uniform"``,
    ``n[b][s] = m_b // S + (s < m_b % S)`` (:func:`~.remasking.transfer_schedule`), or ``"ascending"``
    (:func:`ascending_counts`)."""
    if schedule == "ascending":
        return ascending_counts(masked, steps)
    return [[m // steps + (s < m % steps) for s in range(steps)] for m in masked]


def eos_gamma(step: int, total_steps: int, eos_min_gamma: float, eos_max_gamma: float, schedule: str) -> float:
    """``γ_s``, the scale of a sampled EOS's confidence at global step ``step`` (module docstring)."""
    s = min(max(step, 0), total_steps - 1)
    if schedule == "ascending":
        t = (2 ** (s + 1) - 1) / 2**total_steps
    else:
        t = s / (total_steps - 1) if total_steps > 1 else 1.0
    return eos_min_gamma + (eos_max_gamma - eos_min_gamma) * t


def reject_eos(confidence: torch.Tensor, tokens: torch.Tensor, opts, step: int) -> torch.Tensor:
    """EOSER: ``confidence`` with the entries whose sampled ``tokens`` are EOS ids scaled by :func:`eos_gamma` (the
    same tensor when ``opts.eos_min_gamma`` is ``None``). ``opts``: the sampler's
    :class:`~trl_dllm.core.sampling.options.DecodingOptions`."""
    if opts.eos_min_gamma is None:
        return confidence
    gamma = eos_gamma(step, opts.diffusion_steps, opts.eos_min_gamma, opts.eos_max_gamma, opts.step_schedule)
    is_eos = torch.zeros_like(tokens, dtype=torch.bool)
    for eos_id in opts.eos_token_ids:
        is_eos |= tokens == int(eos_id)
    return torch.where(is_eos, confidence * gamma, confidence)


def schedule_fields(args) -> dict:
    """The decoding fields of a config (any object with the fields of :data:`SAMPLER_OPTIONS`) that differ from their
    defaults, as sampler keywords: ``{}`` leaves every sampler as it was."""
    values = {option.keyword: getattr(args, option.field, option.default) for option in SAMPLER_OPTIONS}
    return {name: value for name, value in values.items() if value != SAMPLER_OPTIONS_DEFAULTS[name]}


def config_problem(args) -> str | None:
    """At construction, before any rollout: each field's own check, then :func:`schedule_problem` in the config's
    names (``max_completion_length``); the EOS ids are the tokenizer's, known later (the sampler checks them)."""
    for option in SAMPLER_OPTIONS:
        problem = option.problem(getattr(args, option.field))
        if problem is not None:
            return problem
    return schedule_problem(
        gen_length=args.max_completion_length, block_length=args.block_length, diffusion_steps=args.diffusion_steps,
        remasking=args.remasking, confidence_threshold=args.confidence_threshold,
        names={"gen_length": "max_completion_length"}, **schedule_fields(args),
    )  # fmt: skip


SAMPLER_OPTIONS_DEFAULTS = {option.keyword: option.default for option in SAMPLER_OPTIONS}
