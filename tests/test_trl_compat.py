"""Guards against silent renames in TRL: the hooks we override exist with the parameters we rely on, and TRL's own
loss path really calls our likelihood hook."""

import inspect

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

# hook -> parameters (after self) that our override relies on, in order
HOOKS = {
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations"],
    "_generate_and_score_completions": ["inputs"],
    "_get_per_token_logps_and_entropies": [
        "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss",
    ],
    "_compute_loss": ["model", "inputs"],
    "_prepare_inputs": ["generation_batch"],
    "_save_optimizer_and_scheduler": ["output_dir"],
    "_load_optimizer_and_scheduler": ["checkpoint"],
    "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "_get_grad_norm": ["model", "grad_norm"],  # transformers' Trainer
    "log": ["logs", "start_time"],
    "train": ["resume_from_checkpoint"],
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_trl_hook_exists_with_expected_signature(hook):
    assert hasattr(GRPOTrainer, hook), f"TRL removed GRPOTrainer.{hook}; our override would never be called"
    params = list(inspect.signature(getattr(GRPOTrainer, hook)).parameters)[1:]
    assert params[: len(HOOKS[hook])] == HOOKS[hook], f"GRPOTrainer.{hook} signature changed: {params}"
    assert hook in DiffusionGRPOTrainer.__dict__, f"DiffusionGRPOTrainer no longer overrides {hook}"


def test_grad_norm_hook_comes_right_before_the_optimizer_step():
    """The non-finite guard drops the gradients in `_get_grad_norm`: it must run after clipping and before `step`."""
    from transformers import Trainer

    source = inspect.getsource(Trainer)
    norm = source.index("grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)")
    step = source.index("self.optimizer.step()", norm)
    assert source.index("self._clip_grad_norm(model)") < norm < step
    assert "backward" not in source[norm:step] and "zero_grad" not in source[norm:step]


def test_trl_state_we_rely_on_exists():
    source = inspect.getsource(GRPOTrainer)
    for attribute in ("self._step", "self.num_iterations", "self.eos_token_ids", "self._metrics", "self._dist",
                      "self.mask_truncated_completions", "self.num_generations_eval"):
        assert attribute in source, f"GRPOTrainer no longer has {attribute}"
    # the inner-iteration index we compute must follow TRL's buffer reuse rule
    assert "self._step % generate_every" in inspect.getsource(GRPOTrainer._prepare_inputs)
    # our whole-group `_prepare_inputs` replaces exactly this shuffle-then-split of the generation batch
    for step in ("shuffle_sequence_dict(generation_batch)", "split_tensor_dict(generation_batch, self.args.steps_per_generation)"):
        assert step in inspect.getsource(GRPOTrainer._prepare_inputs)


def test_trl_loss_path_calls_our_likelihood_hook(tmp_path, tiny_model_path, monkeypatch):
    args = DiffusionGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                               max_completion_length=4, max_steps=1, loss_type="bnpo", report_to="none",
                               use_cpu=True)
    trainer = DiffusionGRPOTrainer(model=tiny_model_path, reward_funcs=lambda completions, **kw: [1.0, 0.0],
                                   args=args, train_dataset=Dataset.from_dict({"prompt": ["add 1 and 2 ."] * 2}))
    calls = []
    original = DiffusionGRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, *a, **kw):
        out = original(self, *a, **kw)
        calls.append((self._estimation is not None, out[0] is not None))
        return out

    monkeypatch.setattr(DiffusionGRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    batch = trainer._generate_and_score_completions([{"prompt": "add 1 and 2 ."}] * 2)
    calls.clear()
    loss = trainer._compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    assert calls == [(True, True)], "TRL's _compute_loss did not score through our estimator"


# DiffusionDPOTrainer: DPOTrainer hook -> parameters (after self) our override relies on
DPO_HOOKS = {"_compute_loss": ["model", "inputs", "return_outputs"], "log": ["logs", "start_time"]}


@pytest.mark.parametrize("hook", sorted(DPO_HOOKS))
def test_dpo_hook_exists_with_expected_signature(hook):
    from trl import DPOTrainer

    from trl_dllm import DiffusionDPOTrainer

    params = list(inspect.signature(getattr(DPOTrainer, hook)).parameters)[1:]
    assert params[: len(DPO_HOOKS[hook])] == DPO_HOOKS[hook], f"DPOTrainer.{hook} signature changed: {params}"
    assert hook in DiffusionDPOTrainer.__dict__


def test_dpo_scores_through_the_fused_head_with_the_batch_keys():
    """DiffusionDPOTrainer replaces the fused head TRL installs, and its seeds reach both scoring calls as an extra
    batch key: TRL must still score the policy and the reference by `model(**model_kwargs, ..., fused_lm_head=True)`
    with `model_kwargs` taken from the batch, and install the head on the policy's base model and the reference."""
    from trl import DPOTrainer

    loss = inspect.getsource(DPOTrainer._compute_loss)
    assert "model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}" in loss
    assert "outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)" in loss
    assert "self.ref_model(**ref_model_kwargs, labels=labels, fused_lm_head=True)" in loss
    init = inspect.getsource(DPOTrainer.__init__)
    assert "add_fused_lm_head(self.model.get_base_model() if is_peft_model(self.model) else self.model" in init
    assert "add_fused_lm_head(self.ref_model)" in init
