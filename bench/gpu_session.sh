#!/usr/bin/env bash
# What a GPU session measures first (docs/gpu.md, "The next session's command"): run from the checkout's root on the
# device machine, with the wheel folder of `python -m bench.gpu_wheels --out wheels` carried; writes into $OUT. One
# command, under 600 s: the soak's resume diagnosis, DiffusionGemma's row-by-row sampler, LLaDA2's LoRA update, then
# LLaDA2's cuda_graphs_compile setting with the time left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> $OUT/device.txt 2>&1
# 1. the soak with the digests of each step's inputs: where a resumed run parts from the uninterrupted one
timeout 100 python3 -m bench.gpu_soak --out $OUT/soak > $OUT/soak.log 2>&1; echo "soak rc $? at ${SECONDS}s"
# 2. DiffusionGemma-26B-A4B at the recipe's 128 steps (the row-by-row sampler), against its floors
timeout 170 python3 -m bench.gpu --families --skip-trl --skip-launch --skip-soak --skip-plan --diffusion-gemma \
  --out $OUT/dg --budget 1000 > $OUT/dg.log 2>&1; echo "dg rc $? at ${SECONDS}s"
# 3. LLaDA2.0-mini: plain forward, rollouts (eager, cuda_graphs), and its LoRA recipe's update
timeout 220 python3 -m bench.gpu --families llada2 --skip-trl --skip-launch --skip-soak --skip-plan --skip-numerics \
  --out $OUT/llada2 --budget 1000 > $OUT/llada2.log 2>&1; echo "llada2 rc $? at ${SECONDS}s"
# 4. LLaDA2.0-mini's cuda_graphs_compile setting, with whatever time is left (cut by the timeout, it keeps the parts
#    finished before)
left=$((585 - SECONDS))
timeout $left python3 -m bench.gpu --families llada2 --compile --compiled-settings cuda_graphs_compile --skip-trl \
  --skip-launch --skip-soak --skip-plan --skip-numerics --skip-moe-update --out $OUT/llada2_cgc --budget 1000 \
  > $OUT/llada2_cgc.log 2>&1; echo "llada2_cgc rc $? at ${SECONDS}s (had ${left}s)"
tail -3 $OUT/soak.log $OUT/dg.log $OUT/llada2.log $OUT/llada2_cgc.log
