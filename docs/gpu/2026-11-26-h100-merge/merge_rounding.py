"""bf16 rounding of a LoRA merge, on CPU: python docs/gpu/2026-11-26-h100-merge/merge_rounding.py

One 4096 x 4096 bf16 weight (normal, std 0.02: the random initialisation of the bench's models) and a rank-128 LoRA
change of it (A as PEFT initialises it, B random), scaled to a root-mean-square of 1e-6 ... 1e-3. Merged as PEFT
merges (`weight += delta.to(weight.dtype)`), unmerged as PEFT unmerges (`weight -= delta.to(weight.dtype)`). Prints
how much of the change the merged weight keeps (its projection on the change, and the error relative to the change)
and how many weights PEFT's unmerge alone leaves off their value.
"""

import torch

generator = torch.Generator().manual_seed(0)
weight = (torch.randn(4096, 4096, generator=generator) * 0.02).to(torch.bfloat16)
lora_a = (torch.rand(128, 4096, generator=generator) * 2 - 1) / 4096**0.5  # PEFT: kaiming_uniform(a=sqrt(5))
for rms in (1e-6, 1e-5, 1e-4, 1e-3):
    delta = torch.randn(4096, 128, generator=generator) @ lora_a
    delta *= rms / delta.pow(2).mean().sqrt()
    merged = weight + delta.to(torch.bfloat16)
    kept = merged.float() - weight.float()
    along = float((kept * delta).sum() / delta.pow(2).sum())
    error = float((kept - delta).norm() / delta.norm())
    unmerged = merged - delta.to(torch.bfloat16)
    changed = float((unmerged != weight).float().mean()) * 100
    largest = float((unmerged.float() - weight.float()).abs().max())
    print(f"rms(delta)={rms:g}: merged keeps {along:.3f} of the change, error {error:.3f} of it; "
          f"PEFT's unmerge leaves {changed:.4f}% of the weights off (at most {largest:.2e})")
