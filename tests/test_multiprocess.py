"""Two-process training on CPU, for real: the tiny recipes under `torchrun` (DDP) and `accelerate launch` with the
DeepSpeed ZeRO-2 / ZeRO-3 CPU configs (full fine-tuning and LoRA). Each run must train (finite losses, weights moved),
save, and the saved model must load.

accelerate's MULTI_CPU config starts a single process unless launched through mpirun, so DDP goes through torchrun.
DeepSpeed 0.19.8 picks its CPU accelerator and builds its shared-memory comm op with gcc on first use (~1.5 min once,
cached in ~/.cache/torch_extensions).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_dllm.core.objectives import OBJECTIVES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: list[str], recipe: str, model_path: str, output_dir: Path, *flags: str, processes: int = 2,
           program: tuple[str, ...] = ("-m", "trl_dllm", "grpo")) -> str:
    """`program` (`trl-dllm grpo`, or a script taking its arguments) under `launcher` with the tiny `recipe`."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "TRL_DLLM_TINY_MODEL": model_path,
    }
    command = [*launcher, *program, "--config", f"recipes/tiny/{recipe}"]
    command += ["--output_dir", str(output_dir), *flags]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert f"trained on {processes} process(es)" in result.stdout, result.stdout[-3000:]
    return result.stdout + result.stderr


def torchrun(processes: int = 2) -> list[str]:
    port = str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", port]


def accelerate_command() -> str:
    """The `accelerate` launcher of the interpreter running the tests (its environment's `bin/`, also when that
    environment is not activated, as under `make test-slow`), else the one on PATH."""
    beside = Path(sys.executable).parent / "accelerate"
    accelerate_cli = str(beside) if beside.is_file() else shutil.which("accelerate")
    assert accelerate_cli, f"no accelerate command beside {sys.executable} or on PATH"
    return accelerate_cli


def accelerate(config: str) -> list[str]:
    accelerate_cli = accelerate_command()
    port = ["--main_process_port", str(free_port())]
    return [accelerate_cli, "launch", "--config_file", f"recipes/accelerate/{config}", *port]


def assert_trained(output_dir: Path, steps: int = 2):
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [log["loss"] for log in state["log_history"] if "loss" in log]
    assert len(losses) == steps and torch.isfinite(torch.tensor(losses)).all(), state["log_history"]


def assert_full_model_changed(output_dir: Path, model_path: str):
    before, after = load_file(Path(model_path) / "model.safetensors"), load_file(output_dir / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(after[k].shape == before[k].shape for k in before)  # ZeRO-3 saved whole tensors, not shards
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert not model.config.is_causal


def test_ddp_torchrun(tiny_model_path, tmp_path):
    output = launch(torchrun(), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path)
    assert "broadcast_buffers` is deprecated" not in output  # our ddp_broadcast_buffers=False, without torch's warning
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero2(tiny_model_path, tmp_path):
    launch(accelerate("zero2_cpu.yaml"), "espo_countdown.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero3(tiny_model_path, tmp_path):
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    assert_full_model_changed(tmp_path, tiny_model_path)


def test_deepspeed_zero3_compiled_sampler(tiny_model_path, tmp_path, monkeypatch):
    """`generation_compile` on a bidirectional model without a cache, under ZeRO-3: the forward (its parameters
    gathered by DeepSpeed's hooks) stays eager, the sampler's work after it runs compiled (Inductor wrote kernels to
    its cache), and it trains."""
    kernels = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(kernels))
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path / "out",
           "--generation_compile", "true", "--max_steps", "1")  # fmt: skip
    assert_trained(tmp_path / "out", steps=1)
    assert any(path.suffix == ".py" for path in kernels.rglob("*")), "Inductor compiled nothing"


def test_deepspeed_zero3_lora(tiny_model_path, tmp_path):
    from peft import PeftModel

    launch(accelerate("zero3_cpu.yaml"), "diffu_grpo_sudoku_lora.yaml", tiny_model_path, tmp_path)
    assert_trained(tmp_path)
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: the adapter trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    merged = PeftModel.from_pretrained(base, tmp_path).merge_and_unload()
    assert merged.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)


def test_deepspeed_zero3_native_llada(original_checkpoints, tmp_path):
    """A LLaDA checkpoint given by name loads natively under ZeRO-3 (parameters partitioned at load), trains, and is
    saved whole in LLaDA's original layout. (The recipe's GSM8K rewards are all 0 on this random model's text, so the
    weights need not move: what is checked is loading, training steps and the saved layout.)"""
    path = original_checkpoints["llada"]
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", path, tmp_path)
    assert_trained(tmp_path)
    before, after = load_file(Path(path) / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and "model.transformer.blocks.0.attn_out.weight" in after
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 shards
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llada"


def test_deepspeed_zero3_native_llada2(original_checkpoints, tmp_path):
    """A tiny LLaDA2 (MoE, block diffusion) checkpoint given by name loads natively under ZeRO-3, trains with the
    tiny block-diffusion StableDRL recipe on two CPU processes, and is saved whole in LLaDA2's original layout."""
    path = original_checkpoints["llada2"]
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k_block.yaml", path, tmp_path, "--model_name_or_path", path)
    assert_trained(tmp_path)
    before, after = load_file(Path(path) / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and "model.layers.1.mlp.experts.7.down_proj.weight" in after
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 shards
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llada2_moe"


ROUTING_SCRIPT = '''
"""`trl-dllm grpo` with LLaDA2's router steered per process, recording per process the experts selected (every
forward: rollouts and updates) and the experts trained (selected at a token the loss's gradient reaches)."""
import json, os, sys
from collections import Counter
import trl_dllm
from trl_dllm.models.families.llada2 import LLaDA2Gate
from trl_dllm.scripts.grpo import main

rank, selected, trained, route = int(os.environ["RANK"]), Counter(), Counter(), LLaDA2Gate.forward

def steered_bias(gate):  # the expert bias only selects experts (their weights are the unbiased scores): +10 on the
    # half of the experts whose ZeRO-3 shard the other process holds (rank 0: the last half, rank 1: the first)
    half = gate.num_experts // 2
    steer = gate.expert_bias.new_zeros(gate.num_experts)
    (steer[half:] if rank == 0 else steer[:half]).fill_(10.0)
    return gate.expert_bias + steer

def counted(gate, hidden):
    router_logits, weights, experts = route(gate, hidden)
    selected.update(experts.flatten().tolist())
    if hidden.requires_grad:  # the MLP is token-wise: a token's input has a gradient iff its output has
        reached = lambda grad: experts[grad.reshape(-1, grad.shape[-1]).abs().sum(-1) > 0].flatten().tolist()
        hidden.register_hook(lambda grad: trained.update(reached(grad)))
    return router_logits, weights, experts

LLaDA2Gate.e_score_correction_bias = property(steered_bias)  # what DeepSeek-V3's router adds before its top-k
LLaDA2Gate.forward = counted
main(sys.argv[1:])
with open(os.path.join(os.path.dirname(__file__), f"routing_rank{rank}.json"), "w") as f:
    json.dump({"trl_dllm": trl_dllm.__file__, "selected": dict(sorted(selected.items())),
               "trained": dict(sorted(trained.items()))}, f)
'''


def test_deepspeed_zero3_llada2_processes_route_to_different_experts(original_checkpoints, tmp_path, monkeypatch):
    """Stacked experts under ZeRO-3: each stacked expert parameter is gathered once per layer, whatever a process's
    tokens route to. A tiny LLaDA2 (8 experts, top-2, full fine-tuning) on two CPU processes whose routers are steered
    apart through LLaDA2's own expert bias: rank 0 selects only experts 4-7, rank 1 only 0-3, and each records the
    experts it selected and those its loss's gradient reached. ZeRO-3 partitions each stacked parameter in halves
    (rank 0 holds experts 0-3, rank 1 experts 4-7), so a process's expert gradients all belong to the other's shard.
    The run trains without hanging, and the experts that moved are exactly those the gradient of either process
    reached: every expert's gradient was reduced across processes (and, AdamW without weight decay, no other expert
    moved). The rewards spread (SPREAD_REWARD), so there is a gradient; the model is saved whole in LLaDA2's
    released layout (one tensor per expert)."""
    path = original_checkpoints["llada2"]
    script = tmp_path / "steered_grpo.py"
    script.write_text(ROUTING_SCRIPT)
    (tmp_path / "spread_reward.py").write_text(SPREAD_REWARD)  # beside the script: on its sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))  # this checkout
    output = tmp_path / "out"
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k_block.yaml", path, output, "--model_name_or_path", path,
           "--reward_funcs", "spread_reward.spread", program=(str(script),))  # fmt: skip
    routing = [json.loads((tmp_path / f"routing_rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(routing):  # {expert: token slots}, over the layer's forwards (`pytest -s` shows it)
        print(f"rank {rank}: selected {record['selected']}, trained {record['trained']}")
    assert all(Path(r["trl_dllm"]).is_relative_to(ROOT) for r in routing), routing  # the package under test
    selected = [{int(e) for e in r["selected"]} for r in routing]
    trained = [{int(e) for e in r["trained"]} for r in routing]
    assert selected[0] and selected[0] <= {4, 5, 6, 7} and selected[1] and selected[1] <= {0, 1, 2, 3}, routing
    assert trained[0] and trained[0] <= selected[0] and trained[1] and trained[1] <= selected[1], routing
    assert_trained(output)
    before, after = load_file(Path(path) / "model.safetensors"), load_file(output / "model.safetensors")
    assert before.keys() == after.keys() and "model.layers.1.mlp.experts.7.down_proj.weight" in after
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 shards
    expert_keys = {e: [k for k in before if k.startswith(f"model.layers.1.mlp.experts.{e}.")] for e in range(8)}
    assert all(len(keys) == 3 for keys in expert_keys.values())  # the tiny LLaDA2: layer 0 dense, layer 1 routed
    moved = {e for e, keys in expert_keys.items() if any(not torch.equal(before[k], after[k]) for k in keys)}
    assert moved == trained[0] | trained[1], (moved, routing)


# The DiffusionGemma recipe at tiny sizes on CPU (its ZeRO-3 and activation checkpointing kept).
DIFFUSION_GEMMA_FLAGS = (
    "--dtype", "float32", "--bf16", "false", "--use_cpu", "true", "--data_files", "tests/fixtures/gsm8k.jsonl",
    "--max_completion_length", "32", "--block_length", "32", "--diffusion_steps", "4", "--num_generations", "2",
    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_steps", "2", "--mc_samples", "1",
    "--learning_rate", "0.1", "--save_strategy", "no", "--logging_steps", "1",
)  # fmt: skip


def test_deepspeed_zero3_lora_views(tiny_model_path, tmp_path):
    """LoRA with activation checkpointing and an estimate of two forwards per micro-batch (elbo, mc_samples 2) under
    ZeRO-3 with every parameter partitioned, two CPU processes. TRL makes checkpointing reentrant there, which failed in
    DeepSpeed's gradient reduction (one H200 and CPU, 2026-11-27: the README's LoRA recipe under zero3.yaml); with
    DeepSpeed 0.19.8 the trainer makes it non-reentrant again, says so, and the run trains."""
    config = [accelerate_command(), "launch", "--config_file", "tests/fixtures/zero3_cpu_partitioned.yaml",
              "--main_process_port", str(free_port())]  # fmt: skip
    log = launch(config, "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path, "--use_peft", "true", "--lora_r", "4",
                 "--lora_target_modules", "all-linear", "--activation_checkpointing", "true")  # fmt: skip
    assert_trained(tmp_path)
    assert "use_reentrant=True (TRL's choice for LoRA under ZeRO-3) is set to False" in log
    lora_b = [v for k, v in load_file(tmp_path / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: the adapter trained


def test_deepspeed_zero3_diffusion_gemma_lora(tmp_path):
    """The DiffusionGemma recipe (uniform_block, StableDRL, the reference LoRA, activation checkpointing on) on a tiny
    checkpoint under ZeRO-3 on two CPU processes, at tiny sizes: trains 2 steps with finite losses, and its LoRA
    adapters move. TRL forces reentrant checkpointing for PEFT under ZeRO-3, which this family's decoder cannot
    backpropagate through; the trainer makes it non-reentrant and says so."""
    from trl_dllm.models.families import diffusion_gemma

    path = diffusion_gemma.save_tiny(str(tmp_path / "tiny-diffusion-gemma"))
    output = tmp_path / "out"
    log = launch(accelerate("zero3_cpu.yaml"), "../diffusion_gemma/stabledrl_gsm8k_lora.yaml", path, output,
                 "--model_name_or_path", path, *DIFFUSION_GEMMA_FLAGS)  # fmt: skip
    assert_trained(output)
    assert "use_reentrant=True (TRL's choice for PEFT under ZeRO-3, or yours) is set to False" in log
    lora_b = [v for k, v in load_file(output / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: the adapters trained


def test_ddp_diffusion_gemma_lora(tmp_path):
    """The DiffusionGemma recipe under DDP (torchrun, two CPU processes): `uniform_block` encodes the context once through
    the model inside DDP's wrapper (which forwards no attributes) and decodes through the wrapper; trains 2 steps with
    finite losses and the adapters move."""
    from trl_dllm.models.families import diffusion_gemma

    path = diffusion_gemma.save_tiny(str(tmp_path / "tiny-diffusion-gemma"))
    output = tmp_path / "out"
    launch(torchrun(2), "../diffusion_gemma/stabledrl_gsm8k_lora.yaml", path, output, "--model_name_or_path", path,
           *DIFFUSION_GEMMA_FLAGS)  # fmt: skip
    assert_trained(output)
    lora_b = [v for k, v in load_file(output / "adapter_model.safetensors").items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)


def test_deepspeed_zero3_diffusion_gemma_from_an_sft_adapter(tmp_path):
    """docs/quickstart.md's SFT -> RL (step 3) under ZeRO-3 on two CPU processes: the DiffusionGemma recipe with an SFT
    LoRA adapter folder as `model_name_or_path` trains that adapter on, from its saved values."""
    from peft import get_peft_model

    from trl_dllm.models.families import diffusion_gemma
    from trl_dllm.models.loading import load_pretrained

    path = diffusion_gemma.save_tiny(str(tmp_path / "tiny-diffusion-gemma"))
    sft = get_peft_model(load_pretrained(path), diffusion_gemma.lora_config())  # the recipe's LoRA, as TRL's SFT
    with torch.no_grad():
        for name, param in sft.named_parameters():
            if "lora_B" in name:  # as after an SFT: not PEFT's zero init
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    sft.save_pretrained(tmp_path / "sft")
    output = tmp_path / "out"
    launch(accelerate("zero3_cpu.yaml"), "../diffusion_gemma/stabledrl_gsm8k_lora.yaml", path, output,
           "--model_name_or_path", str(tmp_path / "sft"), *DIFFUSION_GEMMA_FLAGS)  # fmt: skip
    assert_trained(output)
    before = load_file(tmp_path / "sft" / "adapter_model.safetensors")
    after = load_file(output / "adapter_model.safetensors")
    assert before.keys() == after.keys() and all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the adapter did not move"


def test_deepspeed_zero3_native_llada_moe(original_checkpoints, tmp_path):
    """A tiny LLaDA-MoE (MoE, bidirectional) checkpoint given by name loads natively under ZeRO-3, trains with the tiny
    StableDRL recipe on two CPU processes, and is saved whole in LLaDA-MoE's original layout (one module per expert)."""
    path = original_checkpoints["llada_moe"]
    launch(accelerate("zero3_cpu.yaml"), "stabledrl_gsm8k.yaml", path, tmp_path, "--model_name_or_path", path)
    assert_trained(tmp_path)
    before, after = load_file(Path(path) / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and "model.layers.1.mlp.experts.7.down_proj.weight" in after
    assert all(after[k].shape == before[k].shape for k in before)  # whole tensors, not ZeRO-3 shards
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LLaDAMoEModelLM"]


def step_logs(output_dir: Path) -> list[dict]:
    return [log for log in json.loads((output_dir / "trainer_state.json").read_text())["log_history"] if "loss" in log]


@pytest.fixture(scope="module")
def one_process_run(tiny_model_path, tmp_path_factory):
    """The tiny StableDRL recipe for 4 steps on 1 process with the global batch of 4 rows: 2 groups of 2, so that on
    2 processes every group stays on one process (StableDRL normalises its weights over the part of a group present)."""
    output_dir = tmp_path_factory.mktemp("one_process")
    launch(torchrun(1), "stabledrl_gsm8k.yaml", tiny_model_path, output_dir, "--max_steps", "4",
           "--per_device_train_batch_size", "4", "--num_generations", "2", processes=1)
    return output_dir


@pytest.mark.parametrize("launcher", ["ddp", "zero2", "zero3"])
def test_one_and_two_processes_give_the_same_run(tiny_model_path, tmp_path, one_process_run, launcher):
    """Randomness by sample (trl_dllm/seeding.py): the same global batch of 4 rows, on 1 process x 4 rows or 2
    processes x 2 rows (DDP, ZeRO-2, ZeRO-3), gets the same completions, masks and per-step losses (4 steps)."""
    command = torchrun(2) if launcher == "ddp" else accelerate(f"{launcher}_cpu.yaml")
    launch(command, "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path, "--max_steps", "4",
           "--per_device_train_batch_size", "2", "--num_generations", "2")
    one, two = step_logs(one_process_run), step_logs(tmp_path)
    assert [log["step"] for log in one] == [log["step"] for log in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        for key in ("reward", "completions/mean_length", "ratio/max", "grad_norm", "estimator/mc_variance"):
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a, b)
    first, second = load_file(one_process_run / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    for name, value in first.items():
        torch.testing.assert_close(second[name], value, rtol=0, atol=1e-5, msg=name)


def test_fsdp_on_cpu_processes_warns_and_trains_replicas(tiny_model_path, tmp_path):
    """accelerate 1.15 enables FSDP only on accelerators: on 2 CPU processes an FSDP2 config is dropped and the run is
    DDP. The trainer says so at construction instead of letting the user believe the model is sharded."""
    fsdp = ("--fsdp", "full_shard auto_wrap", "--fsdp_config",
            '{"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}')
    output = launch(torchrun(2), "stabledrl_gsm8k.yaml", tiny_model_path, tmp_path, *fsdp)
    assert "FSDP was requested" in output and "these cpu processes train full replicas (DDP)" in output
    assert_trained(tmp_path)


FAULT_SCRIPT = '''
import json, sys, torch
from datasets import Dataset
from transformers import TrainerCallback
from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

model_path, output_dir = sys.argv[1], sys.argv[2]
args = DiffusionGRPOConfig(output_dir=output_dir, per_device_train_batch_size=2, num_generations=2,
    max_completion_length=8, block_length=4, diffusion_steps=4, max_steps=3, learning_rate=0.05, logging_steps=1,
    save_strategy="no", report_to="none", use_cpu=True, loss_type="stabledrl", temperature=1.0)
data = Dataset.from_dict({"prompt": [f"add {i} and {i + 1} ." for i in range(8)]})
trainer = DiffusionGRPOTrainer(model=model_path, args=args, train_dataset=data,
                               reward_funcs=lambda completions, **kw: [float(len(c) % 3) for c in completions])
rank, state = trainer.accelerator.process_index, {"active": False}
snapshots = {}

def hook(module, inputs):  # +inf into the LM head (so +inf logits) in rank 0's current-policy forward of step 2 only
    # (on the head's input: with TRL's chunked kernel the head's output is the scored tokens' log-probs, not logits)
    active = state["active"] and rank == 0 and torch.is_grad_enabled()
    return (inputs[0] + float("inf"), *inputs[1:]) if active else None

class Faults(TrainerCallback):
    def on_step_begin(self, args, s, control, **kw):
        state["active"] = s.global_step + 1 == 2
    def on_step_end(self, args, s, control, model=None, **kw):
        snapshots[s.global_step] = [p.detach().clone() for p in trainer.accelerator.unwrap_model(model).parameters()]

trainer.model.lm_head.register_forward_pre_hook(hook)
trainer.add_callback(Faults())
snapshots[0] = [p.detach().clone() for p in trainer.model.parameters()]
trainer.train()
moved = {k: max((a - b).abs().max().item() for a, b in zip(snapshots[k], snapshots[k - 1])) for k in (1, 2, 3)}
finite = all(torch.isfinite(p).all().item() for p in snapshots[3])
logs = [log["nonfinite/skipped_steps"] for log in trainer.state.log_history if "loss" in log]
with open(f"{output_dir}/faults_{rank}.json", "w") as f:
    json.dump({"moved": moved, "finite": finite, "skipped": logs}, f)
trainer.accelerator.print("trained on", trainer.accelerator.num_processes, "process(es)")
trainer.accelerator.wait_for_everyone()  # every rank done before any tears down its gloo threads
trainer.end()  # destroys the process group: left to interpreter exit, rank 1 once aborted in CI
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)  # gloo/DeepSpeed threads still abort at interpreter teardown now and then (CI, ZeRO-2)
'''


@pytest.mark.parametrize("launcher", ["torchrun", "zero2"])
def test_nonfinite_step_on_one_process_is_skipped_on_all(tiny_model_path, tmp_path, launcher):
    """Infinite logits in rank 0's loss at step 2: both processes skip step 2 (DDP: the guard's gathered flag;
    ZeRO-2: DeepSpeed's own overflow check, counted by the guard), no weight moves, steps 1 and 3 train."""
    script = tmp_path / "faults.py"
    script.write_text(FAULT_SCRIPT)
    command = [*(torchrun(2) if launcher == "torchrun" else accelerate("zero2_cpu.yaml")), str(script)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*command, tiny_model_path, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    for rank in (0, 1):
        report = json.loads((tmp_path / f"faults_{rank}.json").read_text())
        assert report["moved"]["2"] == 0.0 and report["moved"]["1"] > 0 and report["moved"]["3"] > 0, report
        assert report["finite"] and report["skipped"] == [0.0, 1.0, 1.0], report


SPREAD_REWARD = '''def spread(completions, **kwargs):
    """A score that differs between most completions of a random model, so every group has advantages."""
    return [float(sum((i + 1) * ord(ch) for i, ch in enumerate(str(c))) % 997) / 997 for c in completions]
'''


def objective_run(name: str, output_dir: Path, processes: int) -> list[dict]:
    """Objective `name` (its registry entry's first estimator) on the tiny recipe: groups of 2 and 2 rows per
    micro-batch, the global batch of 4 rows as 1 process x 2 accumulation steps or 2 processes x 1."""
    estimator = OBJECTIVES[name].estimators[0]
    recipe = "stabledrl_gsm8k_block.yaml" if estimator in ("block", "block_steps") else "stabledrl_gsm8k.yaml"
    flags = ["--loss_type", name, "--estimator", estimator, "--reward_funcs", "spread_reward.spread", "--max_steps",
             "2", "--num_generations", "2", "--per_device_train_batch_size", "2",
             "--gradient_accumulation_steps", str(2 // processes)]  # fmt: skip
    if estimator == "left_to_right":  # one token per forward, left to right: the rollout's exact likelihood
        flags += ["--block_length", "1", "--diffusion_steps", "8"]
    if name == "mdpo":  # a reward for the prediction of the whole completion at every step: one block
        flags += ["--block_length", "8"]
    if name == "dtreerpo":  # a group of 2 is a one-level tree of 2 leaves
        flags += ["--dtreerpo_root_branches", "2", "--dtreerpo_depth", "1"]
    launch(torchrun(processes), recipe, os.environ["TRL_DLLM_TINY_MODEL"], output_dir, *flags, processes=processes)
    return step_logs(output_dir)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_gives_the_same_losses_on_one_and_two_processes(
    name, tiny_model_path, tiny_block_model_path, tmp_path, monkeypatch
):
    """With 1 process and 2 accumulation steps TRL's row shuffle would split the groups of 2 over the micro-batches;
    an objective defined over groups keeps them whole (`whole_group_batches`, its registry entry's `whole_groups`), so
    1 process and 2 processes compute the same losses, step by step, for every objective of the registry."""
    (tmp_path / "spread_reward.py").write_text(SPREAD_REWARD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRL_DLLM_TINY_MODEL", tiny_model_path)
    monkeypatch.setenv("TRL_DLLM_TINY_BLOCK_MODEL", tiny_block_model_path)
    one, two = objective_run(name, tmp_path / "one", 1), objective_run(name, tmp_path / "two", 2)
    assert [log["step"] for log in one] == [log["step"] for log in two] == [1, 2]
    # The rewards spread, so there is a gradient to compare (the loss itself is about 0 on-policy: the advantages of
    # a group sum to zero and most objectives weight the rows of a group alike).
    assert any(log["grad_norm"] > 1e-6 for log in one), one
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (name, a, b)
        for key in ("grad_norm", "completions/mean_length"):  # ratio/* are per-micro-batch maxima, averaged
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], abs=1e-5), (name, key, a, b)
