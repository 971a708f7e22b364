"""What a compiled LLaDA2 rollout compiles, and how far its logits are from the eager step's (docs/generation.md,
"LLaDA2.0-mini compiled").

    python -m bench.bench_compile_llada2 [--layers 2] [--dtype float32|bfloat16] [--backend inductor]

The benchmark's tiny LLaDA2 (``bench.gpu_parts.QUICK_SHAPES``, ``--layers`` decoder layers), batch 2, prompt 8, 32
tokens in blocks of 4, 32 steps, greedy:

- ``variants``: one compiled rollout at temperature 0.9, its seconds (the first compiles) and TorchDynamo's graphs,
  graph breaks and FX node counts per graph (``torch._dynamo.utils.counters``; run with
  ``TORCH_LOGS=recompiles,graph_breaks`` for the reasons);
- ``logits``: the eager greedy rollout, teacher-forced: each cached step runs the compiled step (``compiled_forward``)
  and then the eager one on the same cache (restored between them); the largest |Δlogit|, argmax flips, and routing
  flips (a token whose top-k experts differ, read by hooks on the routers), in ``--dtype``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from torch._dynamo.utils import counters

from bench import gpu_parts
from trl_dllm.core.sampling import graphs, kv_cache

RECIPE = gpu_parts.Recipe(batch=2, prompt=8, completion=32, block=4, steps=32)


def build(layers: int, dtype: torch.dtype):
    tokenizer, model = gpu_parts.build_model(replace(gpu_parts.QUICK_SHAPES["llada2"], layers=layers))
    model = model.to(dtype)
    ids, mask = gpu_parts.prompt_batch(tokenizer, RECIPE)
    return model, gpu_parts.rollout_runner(model, tokenizer, ids, mask)


def variants(run) -> dict:
    nodes = []
    backend = graphs._BACKEND

    def counted(graph_module, example_inputs):  # the graphs TorchDynamo hands the backend, then the backend itself
        nodes.append(len(graph_module.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(graph_module, example_inputs)

    graphs._BACKEND, graphs._COMPILED = counted, {}
    start = time.perf_counter()
    run(gpu_parts.rollout_config(RECIPE, temperature=0.9, generation_compile=True))
    seconds = time.perf_counter() - start
    graphs._BACKEND = backend
    return {"first_rollout_seconds": round(seconds, 1), "graphs": len(nodes), "nodes": nodes,
            "graph_breaks": sum(counters["graph_break"].values())}  # fmt: skip


def logits(model, run) -> dict:
    routes, steps = [], []
    for module in model.modules():
        if type(module).__name__ == "LLaDA2Gate":
            module.register_forward_hook(lambda gate, inputs, output: routes.append(output[2].sort(-1).values))
    compiled, eager = graphs.compiled_forward(), kv_cache.static_forward

    def compare(model, cache, *step):
        if not cache.keys:  # the first step fills the cache: eager in both
            return eager(model, cache, *step)
        saved = [t.clone() for t in cache.keys + cache.values]
        routes.clear()
        other = compiled(model, cache, *step).float()
        other_routes = list(routes)
        for t, s in zip(cache.keys + cache.values, saved):
            t.copy_(s)
        routes.clear()
        out = eager(model, cache, *step)
        steps.append({"dlogit": (out.float() - other).abs().max().item(), "positions": out.shape[0] * out.shape[1],
                      "argmax_flips": int((out.argmax(-1) != other.argmax(-1)).sum()),
                      "route_flips": sum(int((a != b).any(-1).sum()) for a, b in zip(routes, other_routes)),
                      "routed": sum(a.shape[0] for a in routes)})  # fmt: skip
        return out

    kv_cache.static_forward = compare
    try:
        run(gpu_parts.rollout_config(RECIPE, temperature=0.0))
    finally:
        kv_cache.static_forward = eager
    total = {key: sum(s[key] for s in steps) for key in ("positions", "argmax_flips", "route_flips", "routed")}
    return {"cached_steps": len(steps), "max_dlogit": max(s["dlogit"] for s in steps),
            "first_step_max_dlogit": steps[0]["dlogit"], **total}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    graphs._BACKEND = args.backend
    model, run = build(args.layers, getattr(torch, args.dtype))
    result = {"layers": args.layers, "dtype": args.dtype, "backend": args.backend, "torch": torch.__version__,
              "variants": variants(run)}  # fmt: skip
    torch._dynamo.reset()
    graphs._COMPILED = {}
    result["logits"] = logits(model, run)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
