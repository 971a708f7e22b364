"""Run every benchmark, write ``<out>/<name>.json`` and print them (what ``make bench`` runs).

    python -m bench.run_all [--quick] [--repeats N] [--threads 2] [--out bench_out] [--only generation likelihood ...]

Each benchmark reports ratios measured in one run on this machine (see docs/benchmarks.md): the machine may be
shared, so absolute times move between runs, ratios much less.
"""

from __future__ import annotations

import time

from bench import (
    bench_diffusion_gemma,
    bench_generation,
    bench_host_overhead,
    bench_likelihood,
    bench_rollout_tradeoff,
    bench_train_step,
    bench_update_memory,
)
from bench.common import emit, parser, setup

BENCHMARKS = {
    "generation": bench_generation.run,
    "likelihood": bench_likelihood.run,
    "train_step": bench_train_step.run,
    "update_memory": bench_update_memory.run,
    "rollout": bench_rollout_tradeoff.run,  # also writes rollout_tradeoff.json (the rows)
    "host_overhead": bench_host_overhead.run,
    "diffusion_gemma": bench_diffusion_gemma.run,
}


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=list(BENCHMARKS))
    p.set_defaults(out="bench_out")
    args = p.parse_args(argv)
    size = setup(args)
    repeats = args.repeats or (1 if args.quick else 3)
    results = {}
    for name in args.only:
        start = time.perf_counter()
        options = {"ks": (1, 2)} if args.quick and name == "likelihood" else {}
        if args.quick and name in ("generation", "likelihood"):
            options["vocabs"] = (2 * size.vocab,)  # not the realistic 32k / 126k vocabularies in a smoke run
        options = {"out": args.out} if name == "rollout" else options
        if args.quick and name == "diffusion_gemma":
            options = dict(rows=4, gen_length=32, diffusion_steps=4)
        if name == "update_memory":
            options = {"configs": bench_update_memory.QUICK_CONFIGS if args.quick else bench_update_memory.CONFIGS}
        results[name] = BENCHMARKS[name](size, repeats=repeats, **options)
        results[name]["benchmark_seconds"] = round(time.perf_counter() - start, 1)
        emit(name, results[name], args.out)
    return results


if __name__ == "__main__":
    main()
