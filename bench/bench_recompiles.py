"""Compiled variants of a cached denoising step over rollouts as a trainer makes them, per decoding setting.

    python -m bench.bench_recompiles [--quick] [--samplers block_causal fixed] [--rollouts 10] [--shared-limit]
                                     [--out bench_out]

With ``compile=True`` (the trainer's ``generation_compile``) a cached step is one compiled call
(``loop._forward_step``: the model's step and the sampler's after it), and the first step of a rollout or a refresh
compiles the sampler's step alone (``loop._step_keyed``), as every step of the full-canvas sampler ``fixed`` does
(its forward stays eager). Each shape or branch the compiled code cannot cover compiles
a variant, and a trainer's rollouts change shapes from batch to batch: the prompt length, the left padding, the rows
still decoding, the masked positions left. This benchmark decodes ``--rollouts`` seeded rollouts of varied prompt
lengths (one row left-padded in two of three) in each of three settings in turn — scheduled decoding, EOS early exit,
threshold decoding at 0.9 — and reports per sampler and setting:

- ``fused_graphs`` and ``step_graphs``: the graphs the setting's two regions hold after each rollout (each variant is
  one graph: the step has no graph break);
- ``limit_hits``: TorchDynamo's warnings that a function reached its recompile limit (its later shapes run eagerly).

Each setting compiles in its own region with :data:`trl_dllm.core.sampling.graphs.RECOMPILE_LIMIT` variants;
``--shared-limit`` compiles as before that, with TorchDynamo's defaults (one limit of 8 per function for every
setting). The functions are traced by TorchDynamo with the ``eager`` backend: the variants are TorchDynamo's, the same
whatever backend compiles them, and tracing takes seconds where Inductor takes minutes. Counts are exact and do not
depend on the machine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

from bench.bench_host_overhead import _options, host_size
from bench.common import build, compiled_regions, emit, environment, parser, random_ids, setup

SAMPLERS = ("block_causal", "dual_cache", "prefix_cache", "fixed")
SETTINGS = {"scheduled": {}, "eos_early_exit": dict(eos_early_exit=True), "threshold": dict(confidence_threshold=0.9)}
PROMPT_OFFSETS = (0, 3, 6, 1, 8, 12, 4, 0, 5, 9)  # added to the size's prompt length, rollout by rollout


class _LimitHits(logging.Handler):
    def __init__(self):
        super().__init__()
        self.hits = 0

    def emit(self, record):
        self.hits += "recompile_limit" in record.getMessage()


@contextlib.contextmanager
def counted_regions(shared_limit: bool):
    """Fresh compiled regions, each traced by a backend that keeps its graphs; yields ``{function name: [graphs]}``
    (one list per region built, in order) and the limit-hit counter."""
    from trl_dllm.core.sampling import graphs

    counts: dict[str, list[list]] = {}

    def region(fn):
        graphs_of_region = []
        counts.setdefault(fn.__name__, []).append(graphs_of_region)

        def backend(graph_module, example_inputs):
            graphs_of_region.append(graph_module)
            return graph_module.forward

        options = {} if shared_limit else graphs._region_options()
        return torch.compile(fn, backend=backend, dynamic=None, **options)

    torch._dynamo.reset()
    hits, dynamo_log = _LimitHits(), logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(hits)
    try:
        with compiled_regions(region):
            yield counts, hits
    finally:
        dynamo_log.removeHandler(hits)
        torch._dynamo.reset()


def _rollout(fn, model, options, size, index: int):
    prompt = random_ids(size.batch, size.prompt + PROMPT_OFFSETS[index % len(PROMPT_OFFSETS)], size.vocab, seed=index)
    attention_mask = torch.ones_like(prompt)
    attention_mask[0, : index % 3] = 0
    generators = [torch.Generator().manual_seed(1000 * index + b) for b in range(len(prompt))]
    fn(model, prompt, attention_mask, options=options, generator=generators)


def measure(size, sampler: str, model, tokenizer, rollouts: int, shared_limit: bool) -> dict:
    fn, base = _options(size, model, tokenizer, sampler)
    result = {}
    with counted_regions(shared_limit) as (counts, hits):
        for name, extra in SETTINGS.items():
            options = replace(base, compile=True, **extra)
            fused, step, hits_before = [], [], hits.hits
            for index in range(rollouts):
                _rollout(fn, model, options, size, index)
                fused.append(len(counts.get("_forward_step", [[]])[-1]))
                step.append(len(counts.get("_step_keyed", [[]])[-1]))
            result[name] = {"fused_graphs": fused, "step_graphs": step, "limit_hits": hits.hits - hits_before}
    return result


def run(size, samplers=SAMPLERS, rollouts: int = 10, shared_limit: bool = False) -> dict:
    from trl_dllm.core.sampling import graphs

    size = host_size(size)
    tokenizer, model = build(size)
    model.eval()
    results = {
        "environment": environment(size),
        "recompile_limit": torch._dynamo.config.recompile_limit if shared_limit else graphs.RECOMPILE_LIMIT,
        "regions_per_setting": not shared_limit and bool(graphs._region_options()),
    }
    for sampler in samplers:
        results[sampler] = measure(size, sampler, model, tokenizer, rollouts, shared_limit)
    return results


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS))
    p.add_argument("--rollouts", type=int, default=10, help="rollouts per setting")
    p.add_argument("--shared-limit", action="store_true", help="TorchDynamo's default limit, shared by the settings")
    args = p.parse_args(argv)
    size = setup(args)
    result = run(size, samplers=args.samplers, rollouts=args.rollouts, shared_limit=args.shared_limit)
    emit("recompiles", result, args.out)
    return result


if __name__ == "__main__":
    main()
