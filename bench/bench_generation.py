"""Generation benchmark: what `generate` costs beyond its model forwards (DESIGN §8).

    python -m bench.bench_generation [--quick] [--repeats 3] [--out bench_out]

Reports, measured in one run (see docs/benchmarks.md):
- ``overhead_ratio``: wall time of `generate` / (number of forwards it made × time of one standalone forward of the
  same batch and canvas, LM head on the current block only, measured right before and after; median over repeats).
  Target <= 1.05. ``overhead_ratio_in_run`` divides by the time spent inside its own forwards (forward hooks) instead,
  which is robust to machine load.
- ``block_head``: the same generation through a logits function that runs the LM head on the whole canvas and slices
  afterwards (``logits_to_keep=False``, the reference implementations' way): the speedup of the block-only head.
- ``threshold``: forwards per generated token with Fast-dLLM threshold decoding (if `generate` has
  ``confidence_threshold``), on a copy of the model whose LM head is scaled so that its predictions are confident.
- ``masked_sampling``: at realistic vocabularies (32k, 126k; the model's head resized), `generate`'s overhead over its
  forwards in run with sampling on the still-masked block positions only (the package) and with the step before
  (sampling on every block position, ``_choose_full_block`` below), runs interleaved; and the speedup.
- ``targets``: each ratio with a target, the target and whether it is met.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import torch

from bench.common import (
    REALISTIC_VOCABS,
    ForwardTimer,
    Size,
    build,
    build_with_vocab,
    emit,
    environment,
    floor_ratios,
    median,
    parser,
    random_ids,
    ratio,
    setup,
    target,
    timed,
)
from trl_dllm.core.logits import module_logits_fn
from trl_dllm.core.sampling import (
    REMASKING,
    DecodingOptions,
    generate,
    sample_tokens,
    sampling_log_probs,
    select_above,
    select_top,
)
from trl_dllm.core.sampling import loop as sampling_loop
from trl_dllm.core.sampling.noise import KeyedNoise


def _generate(model, timer, prompt, keep_positions: bool, **options):
    """One seeded generation; returns ``((wall, cpu), (wall, cpu) inside forwards, output)``."""
    timer.reset()
    logits_fn = module_logits_fn(model, logits_to_keep=keep_positions)
    generator = torch.Generator().manual_seed(1)
    wall, cpu, out = timed(generate, logits_fn, prompt, torch.ones_like(prompt), options=DecodingOptions(**options),
                           generator=generator)  # fmt: skip
    return (wall, cpu), (timer.seconds, timer.cpu_seconds), out


def _summary(runs, floors) -> dict:
    """Ratios of ``runs`` (``(timing, inside forwards, output, index of the floor measured just before)``)."""
    out = runs[0][2]
    result = floor_ratios([(*r[0], r[3]) for r in runs], floors, out.num_forwards)
    result["ratio_in_run"] = round(median(r[0][0] / r[1][0] for r in runs), 3)
    result["seconds_per_forward_in_run"] = round(median(r[1][0] for r in runs) / out.num_forwards, 5)
    result.update(num_forwards=out.num_forwards, forwards_per_token=round(out.forwards_per_token, 4))
    return {"overhead_" + k if k.startswith("ratio") else k: v for k, v in result.items()}


def _threshold(model, size: Size, prompt, threshold: float, sharpen: float, temperature: float) -> dict:
    """Threshold decoding on one block, LM head scaled by ``sharpen`` (a random model is never confident)."""
    sharp = copy.deepcopy(model)
    sharp.lm_head.weight.data.mul_(sharpen)
    timer = ForwardTimer(sharp)
    options = dict(mask_token_id=sharp.config.mask_token_id, gen_length=size.block, block_length=size.block)
    options.update(diffusion_steps=size.block, temperature=temperature, confidence_threshold=threshold)
    (wall, _), (inside, _), out = _generate(sharp, timer, prompt, True, **options)
    timer.close()
    return {
        "confidence_threshold": threshold,
        "lm_head_scale": sharpen,
        "gen_length": size.block,
        "num_forwards": out.num_forwards,
        "forwards_per_token": round(out.forwards_per_token, 4),
        "forwards_per_token_one_token_per_step": 1.0,  # the schedule LLaDA's quality numbers use: L steps for L tokens
        "overhead_ratio_in_run": ratio(wall, inside),
    }


def _choose_full_block(logits, masked, num_transfer, opts, generator, **_):
    """The baseline: the denoising step before issue 14, sampling on every block position (committed ones too). The
    loop's keyed noise covers the masked positions only, so this draws its `(b, K, V)` noise from the global RNG."""
    generator = None if isinstance(generator, KeyedNoise) else generator
    log_probs = sampling_log_probs(logits, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
                                   mask_token_id=opts.mask_token_id, min_p=opts.min_p)  # fmt: skip
    tokens = sample_tokens(log_probs, opts.temperature, generator)
    confidence = REMASKING[opts.remasking](log_probs, tokens, generator)
    if num_transfer is None:
        commit = select_above(confidence, masked, opts.confidence_threshold)
    else:
        commit = select_top(confidence, masked, num_transfer)
    token_logprobs = log_probs.gather(-1, tokens[..., None]).squeeze(-1).float()
    return sampling_loop._StepResult(tokens=tokens, commit=commit, logprobs=token_logprobs,
                                     confidence=confidence.masked_fill(~masked, float("-inf")))  # fmt: skip


@contextmanager
def _full_block_sampling():
    original, sampling_loop._choose = sampling_loop._choose, _choose_full_block
    try:
        yield
    finally:
        sampling_loop._choose = original


def _masked_sampling(size: Size, vocabs, repeats: int, steps_per_block: int, temperature: float) -> dict:
    """`generate` on 2 blocks at each vocabulary: overhead in run, masked-only sampling vs every block position."""
    result = {"gen_length": 2 * size.block, "steps_per_block": steps_per_block, "temperature": temperature}
    for vocab in vocabs:
        tokenizer, model = build_with_vocab(size, vocab)
        prompt = random_ids(size.batch, size.prompt, size.vocab, seed=0)
        options = dict(mask_token_id=tokenizer.mask_token_id, gen_length=2 * size.block, block_length=size.block,
                       diffusion_steps=2 * steps_per_block, temperature=temperature)  # fmt: skip
        timer, runs = ForwardTimer(model), {"masked": [], "full_block": []}
        with torch.no_grad():
            _generate(model, timer, prompt, True, **options)  # warm-up
            for _ in range(repeats):  # interleaved: adjacent runs see the same machine
                runs["masked"].append(_generate(model, timer, prompt, True, **options)[:2])
                with _full_block_sampling():
                    runs["full_block"].append(_generate(model, timer, prompt, True, **options)[:2])
        timer.close()
        entry = {name: {"wall_seconds": round(median(r[0][0] for r in rs), 4),
                        "overhead_ratio_in_run": round(median(r[0][0] / r[1][0] for r in rs), 3)}
                 for name, rs in runs.items()}  # fmt: skip
        entry["speedup_generate"] = ratio(entry["full_block"]["wall_seconds"], entry["masked"]["wall_seconds"])
        result[f"vocab_{vocab}"] = entry
        del model
    return result


def run(size: Size, repeats: int = 3, steps_per_block: int = 2, temperature: float = 1.0, threshold: float = 0.9,
        sharpen: float = 32.0, vocabs=REALISTIC_VOCABS) -> dict:  # fmt: skip
    tokenizer, model = build(size)
    prompt = random_ids(size.batch, size.prompt, size.vocab, seed=0)
    num_blocks = size.completion // size.block
    options = dict(mask_token_id=tokenizer.mask_token_id, gen_length=size.completion, block_length=size.block)
    options.update(diffusion_steps=num_blocks * steps_per_block, temperature=temperature)
    canvas = torch.cat([prompt, prompt.new_full((size.batch, size.completion), tokenizer.mask_token_id)], dim=1)
    block = torch.arange(size.prompt, size.prompt + size.block)

    def forward(keep):  # one forward of the batch and canvas generate works on
        return model(input_ids=canvas, attention_mask=torch.ones_like(canvas), logits_to_keep=keep)

    timer = ForwardTimer(model)
    floor, floor_full, runs = [], [], {"block": [], "full": []}
    with torch.no_grad():
        for _ in range(2):  # warm-up: allocator, kernels, one sampling step
            forward(block)
        _generate(model, timer, prompt, True, **{**options, "gen_length": size.block, "diffusion_steps": 1})
        for repeat in range(repeats + 1):  # floors before, between and after the runs (see floor_ratios)
            floor.append(timed(forward, block)[:2])
            floor_full.append(timed(forward, 0)[:2])
            if repeat < repeats:
                runs["block"].append((*_generate(model, timer, prompt, True, **options), repeat))
            if repeat == 0:  # the baseline runs once: its speedup is also measured per forward
                runs["full"].append((*_generate(model, timer, prompt, False, **options), repeat))
    timer.close()
    block_only, full = _summary(runs["block"], floor), _summary(runs["full"], floor_full)
    result = {
        "benchmark": "generation",
        "environment": environment(size),
        "settings": {**{k: v for k, v in options.items() if k != "mask_token_id"}, "repeats": repeats},
        "forward_seconds": round(median(f[0] for f in floor), 5),
        **block_only,
        "target_overhead_ratio": 1.05,
        "block_head": {
            "full_canvas_head": full,
            "speedup_generate": ratio(full["wall_seconds"], block_only["wall_seconds"]),
            "speedup_per_forward_in_run": ratio(
                full["seconds_per_forward_in_run"], block_only["seconds_per_forward_in_run"]
            ),
            "speedup_per_forward_standalone": round(median(f[0] / b[0] for f, b in zip(floor_full, floor)), 3),
        },
    }
    if "confidence_threshold" in {field.name for field in dataclasses.fields(DecodingOptions)}:
        with torch.no_grad():
            result["threshold"] = _threshold(model, size, prompt, threshold, sharpen, temperature)
    else:
        result["threshold"] = {"skipped": "generate() has no confidence_threshold argument"}
    result["masked_sampling"] = _masked_sampling(size, vocabs, repeats, steps_per_block, temperature)
    result["targets"] = {
        "overhead_ratio": target(result["overhead_ratio"], 1.05, "generate / (forwards x one standalone forward)"),
        "overhead_ratio_in_run": target(result["overhead_ratio_in_run"], 1.05, "generate / its own forwards"),
    }
    for vocab in vocabs:
        value = result["masked_sampling"][f"vocab_{vocab}"]["masked"]["overhead_ratio_in_run"]
        result["targets"][f"overhead_ratio_in_run_vocab_{vocab}"] = target(value, 1.05, f"the same, vocabulary {vocab}")
    return result


def main(argv=None) -> dict:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    size = setup(args)
    vocabs = (2 * size.vocab,) if args.quick else REALISTIC_VOCABS
    result = run(size, repeats=args.repeats or (1 if args.quick else 3), vocabs=vocabs)
    emit("generation", result, args.out)
    return result


if __name__ == "__main__":
    main()
