"""`python -m trl_dllm.demo [--quick]`: see `trl_dllm/demo/run.py` and docs/demo.md."""

from . import main

if __name__ == "__main__":
    main()
