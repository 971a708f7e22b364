"""Randomness by sample (trl_dllm/seeding.py): seeds depend on (seed, purpose, generation, global row) only."""

import subprocess
import sys

import torch
from datasets import Dataset

from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer
from trl_dllm.seeding import device_generators, sample_seed, sample_seeds


def test_split_rows_get_the_seeds_of_the_whole_batch():
    whole = sample_seeds(0, "mc", ("train", 3), range(0, 4), columns=2)
    halves = torch.cat([sample_seeds(0, "mc", ("train", 3), range(0, 2), 2), sample_seeds(0, "mc", ("train", 3), range(2, 4), 2)])
    assert whole.shape == (4, 2) and whole.dtype == torch.long
    assert torch.equal(whole, halves)
    assert len(set(whole.flatten().tolist())) == 8  # every row and column its own seed
    assert (whole >= 0).all() and (whole < 2**62).all()


def test_every_part_of_the_key_matters():
    base = sample_seed(0, "mc", ("train", 3), 5, 0)
    others = [sample_seed(1, "mc", ("train", 3), 5, 0), sample_seed(0, "rollout", ("train", 3), 5, 0),
              sample_seed(0, "mc", ("train", 4), 5, 0), sample_seed(0, "mc", ("eval", 3), 5, 0),
              sample_seed(0, "mc", ("train", 3), 6, 0), sample_seed(0, "mc", ("train", 3), 5, 1)]
    assert base not in others and len(set(others)) == len(others)


def test_seeds_are_the_same_in_another_process():
    """Unlike `hash()`, which Python salts per process, the seed is the same in every process."""
    code = "from trl_dllm.seeding import sample_seed; print(sample_seed(0, 'mc', ('train', 3), 5, 0))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == sample_seed(0, "mc", ("train", 3), 5, 0)


def test_device_generators():
    generators = device_generators(torch.tensor([7, 7, 8]), "cpu")
    draws = [torch.rand(3, generator=g) for g in generators]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_generation_chunks_do_not_change_the_run(tmp_path, tiny_model_path):
    """Each row decodes with its own generator: generating the batch at once or one row at a time is the same run."""

    def run(chunk):
        args = DiffusionGRPOConfig(
            output_dir=str(tmp_path / str(chunk)), per_device_train_batch_size=4, num_generations=2,
            max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=2, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, seed=0, loss_type="stabledrl", remasking="random",
            generation_chunk_size=chunk,
        )  # fmt: skip
        data = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
        trainer = DiffusionGRPOTrainer(model=tiny_model_path, args=args, train_dataset=data,
                                       reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])
        trainer.train()
        return [(log["loss"], log.get("completions/mean_length")) for log in trainer.state.log_history if "loss" in log]

    whole, rows = run(None), run(1)
    for (loss_a, length_a), (loss_b, length_b) in zip(whole, rows):
        assert abs(loss_a - loss_b) <= 1e-5 and length_a == length_b
