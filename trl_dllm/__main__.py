"""`python -m trl_dllm ...` is `trl-dllm ...` (and what `accelerate launch -m` / `torchrun -m` run)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
