"""Intermediate rewards (MDPO, arXiv 2508.13148): a reward for every denoising step of a rollout.

A rollout of a run whose objective declares `records_steps` (`loss_type="mdpo"`) records, at every step ``t``, the
canvas ``x_t`` and the one-shot prediction of the whole completion ``x̂0_t``
(:class:`~trl_dllm.core.sampling.running_confidence.StepRecord`). Here, after TRL has scored the final completions,
each step's prediction is decoded like a completion and scored by TRL's own reward calculation
(`GRPOTrainer._calculate_rewards`: the same reward functions, columns and gathering over processes; our override's
bookkeeping of the final rewards is not repeated), the weighted rewards give per-step advantages
(:func:`~trl_dllm.core.objectives.mdpo.step_advantages`, normalised within each prompt's group on the gathered batch),
and each row's ``step_samples`` steps with the largest advantages
(:func:`~trl_dllm.core.objectives.mdpo.select_steps`) go into the batch: their canvases, predictions, the rollout's
log-probs of the predictions and their advantages, `(B, M, L)` and `(B, M)`, which TRL's shuffle and split carry
like any row tensor.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from ..core.objectives.mdpo import select_steps, step_advantages
from ..core.sampling.running_confidence import StepRecord
from .rollouts import Rollout, completion_mask

__all__ = ["decode_predictions", "rollout_fields", "step_batch"]


def rollout_fields(trainer, inputs: list[dict], rollout: Rollout) -> dict[str, torch.Tensor]:
    """What a rollout adds to TRL's batch besides the canvas: `unmask_step` when its trajectory is recorded, and MDPO's
    rewarded steps (:func:`step_batch`) when its steps are."""
    fields = {} if rollout.unmask_step is None else {"unmask_step": rollout.unmask_step}
    return fields if rollout.steps is None else fields | step_batch(trainer, inputs, rollout.steps)


def decode_predictions(trainer, prompts: list, ids: torch.Tensor) -> tuple[list, list[list[int]]]:
    """Completions of prediction ids `(B, L)` as TRL passes them to reward functions (text, or one assistant message
    for conversational prompts), and the id lists cut after the first EOS, as `_generate_single_turn` cuts them."""
    keep = completion_mask(ids, trainer.eos_token_ids, upto_first_eos=True).bool().cpu()
    id_lists = [row[m].tolist() for row, m in zip(ids.cpu(), keep)]
    texts = trainer.processing_class.batch_decode(id_lists, skip_special_tokens=True)
    if is_conversational({"prompt": prompts[0]}):
        return [[{"role": "assistant", "content": text}] for text in texts], id_lists
    return texts, id_lists


def step_batch(trainer, inputs: list[dict], steps: StepRecord) -> dict[str, torch.Tensor]:
    """The batch fields of MDPO's selected steps for this process's rows (see the module docstring), and the step
    rewards' metrics (`mdpo/step_reward_first`, `mdpo/step_reward_last`: the mean weighted reward of the first and last
    steps' predictions)."""
    training = trainer.model.training
    num_generations = trainer.num_generations if training else trainer.num_generations_eval
    prompts = [example["prompt"] for example in inputs]
    batch, num_steps = steps.predictions.shape[:2]
    weights = trainer.reward_weights.to(trainer.accelerator.device)[None]
    rewards = []
    for t in range(num_steps):
        completions, id_lists = decode_predictions(trainer, prompts, steps.predictions[:, t])
        per_func = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, id_lists)  # (N, F) gathered
        rewards.append((per_func * weights).nansum(dim=1))
    step_rewards = torch.stack(rewards, dim=1)
    first = trainer.accelerator.process_index * batch
    advantages = step_advantages(step_rewards, num_generations)[first : first + batch]
    chosen = select_steps(advantages, trainer.args.step_samples)
    metrics = trainer._metrics["train" if training else "eval"]
    metrics["mdpo/step_reward_first"].append(step_rewards[:, 0].mean().item())
    metrics["mdpo/step_reward_last"].append(step_rewards[:, -1].mean().item())
    device = steps.predictions.device
    rows = torch.arange(batch, device=device)[:, None]
    index = chosen.to(device)
    return {
        "mdpo_canvases": steps.canvases[rows, index],
        "mdpo_targets": steps.predictions[rows, index],
        "mdpo_logprobs": steps.logprobs[rows, index],
        "mdpo_advantages": advantages.to(device)[rows, index],
    }
