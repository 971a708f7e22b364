"""Issue 56: the second step that explodes with `beta > 0`, `num_iterations=2` (docs/troubleshooting.md, 'A finite loss
in the millions'). About a minute on 2 CPU cores:

    python -m bench.kl_explosion            # Dream family, width 1024, lr 1e-3, TRL's `grpo` loss

A tiny Dream checkpoint initialised by the family's own code (std 0.02, the real 152k vocabulary) at width 1024, two
optimizer steps on one rollout (reward: the number of even token ids), run four ways: our trainer as it is (TRL's
`use_bias_correction_kl` left unset, so off for the MC-weighted `elbo`), with TRL's correction forced on (the issue's
run), with `estimator="mean_field"` (one log-prob per token) and correction on, and TRL's own `GRPOTrainer` on the same
weights (exact autoregressive log-probs of the same model, correction on). Prints loss, grad norm and TRL's `kl` per
step, and whether the guard skipped the step (`nonfinite/skipped_steps`).
"""

from __future__ import annotations

import logging
import tempfile

from datasets import Dataset

SIZES = dict(hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=2816)
COMMON = dict(per_device_train_batch_size=3, num_generations=3, max_completion_length=8, max_steps=2,
              learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
              bf16=False, beta=0.04, num_iterations=2, loss_type="grpo", gradient_checkpointing=True)  # fmt: skip
DATA = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"add {i} and {i + 1} ."}] for i in range(6)]})


def even_ids(completion_ids, **kwargs):
    return [float(sum(1 for i in ids if i % 2 == 0)) for ids in completion_ids]


def ours(path, out, **overrides):
    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    args = DiffusionGRPOConfig(output_dir=out, block_length=4, diffusion_steps=4, **{**COMMON, **overrides})
    trainer = DiffusionGRPOTrainer(model=path, reward_funcs=even_ids, args=args, train_dataset=DATA)
    trainer.train()
    return trainer.state.log_history


def trls_own(path, out):
    import trl.trainer.grpo_trainer as grpo_trainer
    from trl import GRPOConfig, GRPOTrainer

    from trl_dllm.models.loading import load_pretrained
    from trl_dllm.testing import build_family_tokenizer

    # TRL loads its reference model by name; this folder's config names the family's remote code: load it natively
    grpo_trainer.create_model_from_path = lambda model_id, **kwargs: load_pretrained(model_id)
    trainer = GRPOTrainer(model=load_pretrained(path), processing_class=build_family_tokenizer("dream"),
                          reward_funcs=even_ids, args=GRPOConfig(output_dir=out, **COMMON), train_dataset=DATA)  # fmt: skip
    trainer.train()
    return trainer.state.log_history


def main():
    from trl_dllm.testing import save_tiny_original_checkpoint

    logging.getLogger("trl_dllm.training.watches").setLevel(logging.ERROR)  # the skip is printed below
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_original_checkpoint(f"{tmp}/dream", "dream", **SIZES)
        runs = {
            "ours (use_bias_correction_kl unset: off for elbo)": lambda: ours(path, f"{tmp}/a"),
            "ours, use_bias_correction_kl=True (the issue's run)": lambda: ours(path, f"{tmp}/b",
                                                                                use_bias_correction_kl=True),
            "ours, estimator='mean_field', correction on": lambda: ours(path, f"{tmp}/c", estimator="mean_field"),
            "TRL's GRPOTrainer, same weights, correction on": lambda: trls_own(path, f"{tmp}/d"),
        }  # fmt: skip
        for name, run in runs.items():
            logs = [log for log in run() if "loss" in log and "grad_norm" in log]
            steps = "; ".join(
                f"step {log['step']}: loss {log['loss']:.4g}, grad_norm {log['grad_norm']:.3g}, kl {log['kl']:.4g}"
                + (f", skipped {log['nonfinite/skipped_steps']:g}" if "nonfinite/skipped_steps" in log else "")
                for log in logs
            )
            print(f"{name}: {steps}", flush=True)


if __name__ == "__main__":
    main()
