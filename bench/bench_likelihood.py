"""Likelihood benchmark: estimator time over its forward floor, and peak memory against the MC sample count K.

    python -m bench.bench_likelihood [--quick] [--repeats 3] [--out bench_out]

Reports, measured in one run (see docs/benchmarks.md):
- per estimator configuration (mean_field; elbo with K = 1, 4, 8, antithetic off / on; coupled), under no_grad:
  ``ratio`` = wall time / (forwards it made x time of one standalone forward of the same B rows, logits kept at the
  completion positions as the estimator asks, measured right before and after); ``ratio_cpu`` the same in CPU time;
  ``ratio_in_run`` divides by the time spent inside its own forwards. Configurations of 1-2 forwards run ``repeats``
  times, larger ones once.
- ``memory``: peak memory of elbo at K = 1, 4, 8, without and with grad, and peak(K) / peak(1): see bench_memory.py.
- ``kept_head``: at realistic vocabularies (32k, 126k; the model's head resized), the default estimate (elbo, K = 1,
  antithetic) with the LM head on the masked positions only (the package) and on all completion positions, sliced
  afterwards (the baseline); under no_grad and with grad (estimate + backward), runs interleaved; and the speedups.
- ``targets``: each ratio with a target, the target and whether it is met.
"""

from __future__ import annotations

import torch

from bench import bench_memory
from bench.common import (
    REALISTIC_VOCABS,
    ForwardTimer,
    Size,
    build,
    build_with_vocab,
    emit,
    environment,
    floor_ratios,
    likelihood_inputs,
    median,
    parser,
    ratio,
    setup,
    target,
    timed,
)
from trl_dllm.core.likelihood import estimate
from trl_dllm.core.logits import module_logits_fn


def configurations(ks) -> list[tuple[str, str, dict]]:
    configs = [("mean_field", "mean_field", {})]
    configs += [(f"elbo_k{k}", "elbo", {"mc_samples": k, "antithetic": False}) for k in ks]
    configs += [(f"elbo_k{k}_antithetic", "elbo", {"mc_samples": k, "antithetic": True}) for k in ks]
    return configs + [("coupled_k1", "coupled", {"mc_samples": 1})]


def num_views(estimator: str, options: dict) -> int:
    """Forwards (views of B rows) one call makes with ``mc_batch_size=1``."""
    if estimator == "mean_field":
        return 1
    if estimator == "coupled":  # DiffuCoder's full mask + complementary pair
        return 3 * options["mc_samples"]
    return options["mc_samples"] * (2 if options.get("antithetic") else 1)


def time_estimators(size: Size, ks, repeats: int) -> tuple[list, dict]:
    tokenizer, model = build(size)
    inputs = likelihood_inputs(size, tokenizer.mask_token_id)
    canvas = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    positions = torch.arange(size.prompt, size.prompt + size.completion)

    def forward():  # what one view costs: B rows, logits at the completion positions
        return model(input_ids=canvas, attention_mask=torch.ones_like(canvas), logits_to_keep=positions)

    timer, floor, runs = ForwardTimer(model), [], {}
    with torch.no_grad():
        forward(), estimate("elbo", model, **inputs, mc_samples=1)  # warm-up
        for name, estimator, options in configurations(ks):
            runs[name] = []
            # Interleaved with the floor; a configuration of 4+ forwards runs once, its forwards already average out.
            for _ in range(repeats if num_views(estimator, options) <= 2 else 1):
                floor.append(timed(forward)[:2])
                timer.reset()
                wall, cpu, _ = timed(estimate, estimator, model, **inputs, **options)
                runs[name].append((wall, cpu, len(floor) - 1, timer.seconds, timer.calls))
        floor.append(timed(forward)[:2])
    timer.close()
    results = {}
    for name, estimator, options in configurations(ks):
        calls = runs[name][0][4]
        results[name] = {"estimator": estimator, **options, "num_forwards": calls}
        results[name].update(floor_ratios([r[:3] for r in runs[name]], floor, calls))
        results[name]["ratio_in_run"] = round(median(r[0] / r[3] for r in runs[name]), 3)
    return floor, results


def kept_head(size: Size, vocabs, repeats: int) -> dict:
    """The default estimate with the LM head on the masked positions only vs on every completion position."""
    result = {"estimator": "elbo", "mc_samples": 1, "antithetic": True}
    for vocab in vocabs:
        result[f"vocab_{vocab}"] = _kept_head_at(size, vocab, repeats)
    return result


def _kept_head_at(size: Size, vocab: int, repeats: int) -> dict:
    tokenizer, model = build_with_vocab(size, vocab)
    inputs = likelihood_inputs(size, tokenizer.mask_token_id)
    kept = module_logits_fn(model)

    def full(*args, **kwargs):  # no `takes_keep`: logits at every completion position, then sliced
        return kept(*args, **kwargs)

    def once(logits_fn, grad):
        with torch.set_grad_enabled(grad):
            out = estimate("elbo", logits_fn, **inputs, mc_samples=1, antithetic=True, entropy_grad=False)
            if grad:
                out.logps.sum().backward()
                model.zero_grad(set_to_none=True)

    entry = {}
    for grad in (False, True):
        once(kept, grad)  # warm-up
        times = {"kept": [], "full": []}
        for _ in range(repeats):  # interleaved
            times["kept"].append(timed(once, kept, grad)[0])
            times["full"].append(timed(once, full, grad)[0])
        seconds = {name: round(median(t), 4) for name, t in times.items()}
        entry["grad" if grad else "no_grad"] = {
            "kept_head_seconds": seconds["kept"], "full_head_seconds": seconds["full"],
            "speedup": ratio(seconds["full"], seconds["kept"]),
        }  # fmt: skip
    return entry


def run(size: Size, repeats: int = 3, ks=(1, 4, 8), memory: bool = True, vocabs=REALISTIC_VOCABS) -> dict:
    floor, estimators = time_estimators(size, ks, repeats)
    result = {
        "benchmark": "likelihood",
        "environment": environment(size),
        "repeats": repeats,
        "forward_seconds": round(median(f[0] for f in floor), 5),
        "forward_cpu_seconds": round(median(f[1] for f in floor), 5),
        "estimators": estimators,
        "target_ratio": "~1 (every forward is needed; the rest is bookkeeping)",
    }
    worst = max(estimators, key=lambda name: estimators[name]["ratio_in_run"])
    result["targets"] = {
        "worst_estimator_ratio_in_run": {
            **target(estimators[worst]["ratio_in_run"], 1.07, "estimator time / its own forwards, worst"),
            "estimator": worst,
        },
    }
    if memory:
        result["memory"] = bench_memory.run(size, ks)
        if "skipped" not in result["memory"]:
            k = f"k{max(ks)}"
            value = result["memory"]["grad_auto"]["peak_ratio_to_k1"][k]
            result["targets"][f"memory_grad_{k}_over_k1"] = target(
                value, 1.3, f"peak memory with grad, {k} / k1, trainer default (mc_checkpointing='auto')"
            )
    result["kept_head"] = kept_head(size, vocabs, repeats)
    return result


def main(argv=None) -> dict:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    size = setup(args)
    result = run(size, repeats=args.repeats or (1 if args.quick else 3), ks=(1, 2) if args.quick else (1, 4, 8),
                 vocabs=(2 * size.vocab,) if args.quick else REALISTIC_VOCABS)  # fmt: skip
    emit("likelihood", result, args.out)
    return result


if __name__ == "__main__":
    main()
