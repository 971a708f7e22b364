"""Host work per denoising step, on CPU: aten operations dispatched and host synchronisations, per sampler.

    python -m bench.bench_host_overhead [--quick] [--repeats 3] [--samplers fixed ...] [--compile] [--out bench_out]

On a GPU a denoising step of a small block (SDAR: 4 tokens per row) costs what the host spends launching kernels and
running Python, not arithmetic; on a tiny CPU model the same is true, so this benchmark measures that host work where
no GPU is needed. For every sampler — ``fixed`` (bidirectional, scheduled), ``threshold`` (bidirectional, Fast-dLLM
threshold decoding), ``prefix_cache`` / ``dual_cache`` (Fast-dLLM's approximate caches), ``block_causal`` (exact
block KV cache) — one seeded rollout at temperature 1 with per-row generators (the trainer's setting; EOS early exit
off, its default) reports, per denoising step (= per model forward):

- ``ops_per_step``: aten operations dispatched (a ``TorchDispatchMode`` counter), and ``ops_per_step_outside_model``:
  those dispatched outside the model's ``forward`` (forward pre/post hooks on the model set a flag): the sampler's own
  work, which a GPU runs as that many kernel launches;
- ``syncs_per_step``: operations that make a CUDA host wait for the device — ``aten._local_scalar_dense`` (``.item()``,
  ``bool(t)``, ``int(t)``), ``nonzero``, ``masked_select``, indexing with a boolean mask, ``repeat_interleave`` without
  an output size, ``unique`` — plus calls of ``Tensor.tolist``, ``.cpu()`` and ``.numpy()`` (which dispatch no
  operation on a CPU tensor), counted by wrapping them; ``syncs_per_step_outside_model`` the part outside the model;
- ``seconds_per_step``: wall time per step of the same rollout without the counters (median over repeats),
  ``seconds_per_step_min`` (the fastest repeat: on a shared machine, the least disturbed one) and
  ``tokens_per_second`` (of the median).

With ``compile=True`` (the trainer's ``generation_compile``) every sampler compiles everything it does after a
forward (sampling, selection, the commit, EOS early exit); ``prefix_cache``, ``dual_cache`` and ``block_causal``
compile their cached forward with it, one compiled call per step (a refresh or a rollout's first step, which
allocates the cache, runs the forward eagerly and the sampler's step compiled), while ``fixed`` and ``threshold``
forward the whole canvas eagerly. ``ops_per_step_outside_compiled`` counts the aten operations a compiled rollout
still dispatches eagerly per step outside its compiled calls (``compiled_calls_per_step``, each a few fused kernels),
which is what its host launches one by one. A dispatch-mode counter cannot see inside compiled code (under one,
compiled functions run eagerly), so this rollout runs the compiled functions eagerly with their calls marked
(:func:`count_compiled`).

``targets`` holds each sampler's own host synchronisations per step (at most one) and, at the two sizes whose numbers
before issue 36 are recorded (:data:`BEFORE`, commit 7b6ca6d), the operations outside the model as a fraction of
those (the target is a third): eagerly, and outside the compiled calls.

``--compile`` also times ``block_causal``, ``dual_cache`` and ``fixed`` compiled (``compile=True``, Inductor; the
first two compile their cached steps, ``fixed`` the sampler's work after its full-canvas forward):
``<sampler>_compiled`` holds ``compile_seconds`` (the first rollout, which compiles), ``seconds_per_step``,
``tokens_per_second`` and ``speedup_over_eager`` (against the eager entry of the same run); its counts are the eager
entry's ``*_outside_compiled`` ones.

Counts are exact and do not depend on the machine's load; times do (see docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import (
    DEFAULT,
    QUICK,
    Size,
    build,
    compiled_regions,
    emit,
    environment,
    median,
    parser,
    random_ids,
    setup,
    target,
    timed,
)
from trl_dllm.core.sampling import (
    BlockCausalOptions,
    CachedOptions,
    DecodingOptions,
    generate,
    generate_block_causal,
    generate_cached,
)

SAMPLERS = ("fixed", "threshold", "prefix_cache", "dual_cache", "block_causal")
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive"}
SYNC_METHODS = ("tolist", "cpu", "numpy")
BLOCK_CAUSAL_BLOCK = 4  # SDAR / TraDo's native block: the host-bound case of the issue


def _forces_sync(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":
        return len(args) > 0 and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and len(args) < 3
    if name in ("index", "index_put", "index_put_") and len(args) > 1:  # a boolean index is a nonzero on the device
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


class HostCounter(TorchDispatchMode):
    """Counts aten operations and host synchronisations, in total and outside ``model.forward``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.depth = model, 0
        self.ops = self.ops_outside = self.syncs = self.syncs_outside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        sync = _forces_sync(func, args)
        self.syncs += sync
        if self.depth == 0:
            self.ops_outside += 1
            self.syncs_outside += sync
        return func(*args, **(kwargs or {}))

    def _method_sync(self):
        self.syncs += 1
        self.syncs_outside += self.depth == 0

    @contextlib.contextmanager
    def counting(self):
        def pre(module, args, kwargs):
            self.depth += 1

        def post(module, args, kwargs, output):
            self.depth -= 1

        handles = [self.model.register_forward_pre_hook(pre, with_kwargs=True),
                   self.model.register_forward_hook(post, with_kwargs=True)]  # fmt: skip
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

        def wrap(original):
            def method(tensor, *args, **kwargs):
                self._method_sync()
                return original(tensor, *args, **kwargs)

            return method

        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, wrap(original))
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            for handle in handles:
                handle.remove()


def _options(size: Size, model, tokenizer, sampler: str) -> tuple:
    """``(sampler function, options)`` of one rollout of ``size`` with ``sampler``."""
    options = dict(
        mask_token_id=model.config.mask_token_id, gen_length=size.completion, temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id], return_trajectory=True,
    )  # fmt: skip
    block = BLOCK_CAUSAL_BLOCK if sampler == "block_causal" else size.block
    options.update(block_length=block, diffusion_steps=size.completion // 2 if sampler != "block_causal" else
                   size.completion)  # fmt: skip
    if sampler == "threshold":
        return generate, DecodingOptions(**options, confidence_threshold=0.9)
    if sampler in ("prefix_cache", "dual_cache"):
        return generate_cached, CachedOptions(**options, generation_cache=sampler.split("_")[0])
    if sampler == "block_causal":
        return generate_block_causal, BlockCausalOptions(**options)
    return generate, DecodingOptions(**options)


def _rollout(fn, model, prompt, options):
    generators = [torch.Generator().manual_seed(100 + b) for b in range(len(prompt))]
    return fn(model, prompt, torch.ones_like(prompt), options=options, generator=generators)


def measure(size: Size, sampler: str, model, tokenizer, prompt, repeats: int) -> dict:
    """Counts and wall time per denoising step of one seeded rollout of ``sampler``."""
    fn, options = _options(size, model, tokenizer, sampler)
    counter = HostCounter(model)
    with counter.counting():
        out = _rollout(fn, model, prompt, options)
    steps = out.num_forwards
    _rollout(fn, model, prompt, options)  # warm-up, untimed
    times = [timed(_rollout, fn, model, prompt, options)[0] for _ in range(repeats)]
    seconds = median(times)
    return {
        "steps": steps,
        "block_length": options.block_length,
        "syncs_per_step": round(counter.syncs / steps, 3),
        "syncs_per_step_outside_model": round(counter.syncs_outside / steps, 3),
        "ops_per_step": round(counter.ops / steps, 1),
        "ops_per_step_outside_model": round(counter.ops_outside / steps, 1),
        "seconds_per_step": round(seconds / steps, 6),
        "seconds_per_step_min": round(min(times) / steps, 6),
        "tokens_per_second": round(out.completion_ids.numel() / seconds, 1),
        "wall_seconds": round(seconds, 4),
        **_compiled_counts(fn, model, prompt, options),
    }


def _compiled_counts(fn, model, prompt, options) -> dict:
    counter, calls, steps = count_compiled(fn, model, prompt, options)
    return {
        "ops_per_step_outside_compiled": round(counter.ops_outside / steps, 1),
        "compiled_calls_per_step": round(calls / steps, 2),
        "syncs_per_step_outside_compiled": round(counter.syncs_outside / steps, 3),
    }


def count_compiled(fn, model, prompt, options) -> tuple[HostCounter, int, int]:
    """``(counter, compiled calls, steps)`` of one rollout of ``options`` with ``compile=True`` whose compiled
    functions (those :func:`trl_dllm.core.sampling.graphs.compile_once` builds: the cached forward, the sampler's step
    and the two fused) run eagerly, each call counted as one compiled call and its operations as inside it
    (``counter.ops_outside`` is what stays eager)."""
    counter, calls = HostCounter(model), [0]

    def marked(function):
        def call(*args, **kwargs):
            calls[0] += 1
            counter.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                counter.depth -= 1

        return call

    with compiled_regions(marked), counter.counting():
        out = _rollout(fn, model, prompt, replace(options, compile=True))
    return counter, calls[0], out.num_forwards


COMPILED = ("block_causal", "dual_cache", "fixed")


def measure_compiled(size: Size, sampler: str, model, tokenizer, prompt, repeats: int, eager: dict) -> dict:
    """Wall time per denoising step of ``sampler`` with ``compile=True``: the first rollout compiles (timed apart),
    then ``repeats`` timed ones; ``eager`` is the same sampler's :func:`measure` entry."""
    fn, options = _options(size, model, tokenizer, sampler)
    options = replace(options, compile=True)
    compile_seconds, _, out = timed(_rollout, fn, model, prompt, options)
    times = [timed(_rollout, fn, model, prompt, options)[0] for _ in range(repeats)]
    seconds = median(times)
    steps = out.num_forwards
    return {
        "steps": steps,
        "compile_seconds": round(compile_seconds, 2),
        "seconds_per_step": round(seconds / steps, 6),
        "seconds_per_step_min": round(min(times) / steps, 6),
        "tokens_per_second": round(out.completion_ids.numel() / seconds, 1),
        "speedup_over_eager": round(eager["seconds_per_step"] / (seconds / steps), 3),
    }


def host_size(size: Size) -> Size:
    """The benchmark's size: ``size``'s model and batch, a shorter canvas (host work per step does not grow with it,
    and the counted rollout runs every operation through Python)."""
    return replace(size, prompt=min(size.prompt, 32), completion=min(size.completion, 64))


BEFORE = {
    host_size(QUICK): dict(fixed=83.1, threshold=72.0, prefix_cache=108.6, dual_cache=110.6, block_causal=118.4),
    host_size(DEFAULT): dict(fixed=84.2, threshold=74.6, prefix_cache=131.8, dual_cache=133.8, block_causal=128.1),
}
"""``ops_per_step_outside_model`` of commit 7b6ca6d, the loop before issue 36, at the benchmark's two sizes: this
benchmark run on it (docs/benchmarks.md has the commands; counts do not depend on the machine)."""


def run(size: Size, repeats: int = 3, samplers=SAMPLERS, compile: bool = False) -> dict:
    size = host_size(size)
    tokenizer, model = build(size)
    model.eval()
    prompt = random_ids(size.batch, size.prompt, size.vocab, seed=0)
    results = {"environment": environment(size)}
    for sampler in samplers:
        results[sampler] = measure(size, sampler, model, tokenizer, prompt, repeats)
        if compile and sampler in COMPILED:
            results[f"{sampler}_compiled"] = measure_compiled(size, sampler, model, tokenizer, prompt, repeats,
                                                              results[sampler])  # fmt: skip
    results["targets"] = {
        f"syncs_{sampler}": target(results[sampler]["syncs_per_step_outside_model"], 1,
                                   f"{sampler}: the sampler's host synchronisations per denoising step")
        for sampler in samplers
    }  # fmt: skip
    before = BEFORE.get(size, {})
    for sampler in (s for s in samplers if s in before):
        entry = results[sampler]
        what = f"{sampler}: aten operations per step outside the model over those before issue 36"
        results["targets"][f"ops_{sampler}"] = target(
            round(entry["ops_per_step_outside_model"] / before[sampler], 3), 0.334, f"{what}, eager"
        )
        if "ops_per_step_outside_compiled" in entry:
            results["targets"][f"ops_{sampler}_compiled"] = target(
                round(entry["ops_per_step_outside_compiled"] / before[sampler], 3), 0.334,
                f"{what}, with compile=True (outside the compiled calls)",
            )  # fmt: skip
    return results


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS))
    p.add_argument("--compile", action="store_true", help="also time block_causal, dual_cache and fixed compiled")
    args = p.parse_args(argv)
    size = setup(args)
    result = run(size, repeats=args.repeats or (1 if args.quick else 3), samplers=args.samplers,
                 compile=args.compile)  # fmt: skip
    emit("host_overhead", result, args.out)
    return result


if __name__ == "__main__":
    main()
