"""`trl-dllm eval` over several processes (`torchrun`, `accelerate launch`): each process decodes a share of the
prompt batches, and the first process gathers every sample's record in the order one process writes them.

The batches are those of one process (prompts ``[b, b + eval_batch_size)``), dealt round-robin, so each batch is
decoded with the same rows and the same left padding whatever the number of processes; with each sample's noise drawn
from its own generator (seeded by the prompt and sample indices), N processes give one process's report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UsageError


@dataclass(frozen=True)
class Processes:
    """This process's place among the evaluating processes.

    Args:
        rank (`int`): this process's index (`0` writes the report).
        world_size (`int`): number of processes.
        device (`torch.device`): this process's device (`cuda:<local rank>` on GPUs, else the CPU).
    """

    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def join(cls, use_cpu: bool) -> Processes:
        """Join the processes of the launcher (one process when not launched by one). On a machine without CUDA,
        `cpu=True` is what makes accelerate join the processes of `torchrun` / `accelerate launch` (gloo)."""
        from accelerate import PartialState

        state = PartialState(cpu=use_cpu or not torch.cuda.is_available())
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if state.num_processes != launched:
            raise UsageError(
                f"use_cpu={use_cpu}: the launcher started {launched} processes but they did not join (each would "
                "evaluate every prompt); on a machine without CUDA set use_cpu=true (the default there)."
            )
        return cls(state.process_index, state.num_processes, state.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def batch_starts(self, num_prompts: int, batch_size: int) -> list[int]:
        """The first prompt index of each batch this process decodes: batch ``i`` of one process goes to process
        ``i mod world_size``."""
        return list(range(0, num_prompts, batch_size))[self.rank :: self.world_size]

    def gather(self, records: list[dict], order: Callable[[dict], tuple]) -> list[dict] | None:
        """Every process's `records`, sorted by `order`, on the first process; `None` on the others."""
        if self.world_size == 1:
            return sorted(records, key=order)
        parts = [None] * self.world_size if self.is_main else None
        torch.distributed.gather_object(records, parts, dst=0)
        return sorted((r for part in parts for r in part), key=order) if self.is_main else None
