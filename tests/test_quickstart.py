"""A user script written exactly like TRL's GRPO quickstart, with only the two names swapped, trains the tiny model."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    from datasets import load_dataset
    from trl_dllm import DiffusionGRPOTrainer as GRPOTrainer, DiffusionGRPOConfig as GRPOConfig

    model_path, data_file, output_dir = sys.argv[1:4]
    dataset = load_dataset("json", data_files=data_file, split="train")

    # Dummy reward function: count the number of unique characters in the completions
    def reward_num_unique_chars(completions, **kwargs):
        return [len(set(completion[0]["content"])) for completion in completions]

    training_args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                               max_completion_length=8, max_steps=2, report_to="none", use_cpu=True)
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward_num_unique_chars,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    print("LOSSES", [log["loss"] for log in trainer.state.log_history if "loss" in log])
    """
)


def test_trl_quickstart_with_swapped_names(tmp_path, tiny_model_path):
    data = tmp_path / "prompts.jsonl"
    with data.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"sort {i} 3 1 ."}]}) + "\n")
    script = tmp_path / "train_grpo.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), tiny_model_path, str(data), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [line for line in result.stdout.splitlines() if line.startswith("LOSSES")]
    assert losses and "nan" not in losses[0], result.stdout[-2000:]
    # A quiet console: no warning that is not the user's business (DeepSpeed's CPU notice, transformers' deprecations
    # of names TRL uses, pin_memory without an accelerator), and one line for each choice made for the machine.
    warnings = [line for line in result.stderr.splitlines() if "warn" in line.lower()]
    assert not warnings, warnings
    assert "each rollout batch takes 4 denoising forwards" in result.stdout, result.stdout[-2000:]
