"""DiffusionGemma's sampler alone (``_Sampler.denoise`` of trl_dllm.models.families.diffusion_gemma.sampling), on CPU, at the
released vocabulary and canvas: what one denoising step costs after the model's forward.

    python -m bench.bench_diffusion_gemma_sampler [--rows 1] [--steps 3] [--dtype float32|bfloat16] [--out bench_out]

The model is replaced by a stand-in denoiser that returns fresh float32 logits `(rows, canvas, vocab)` (a copy of a
fixed random tensor, softcapped to ±30 as the model's are) and whose own time is subtracted, so what is measured is
the sampler's step: the temperature schedule, sampling, argmax, the entropy-bound acceptance, the renoising, the
adaptive stopping rule and the self-conditioning input (in ``--dtype``, the embeddings' dtype; the released model's is
bfloat16). Reports:

- ``seconds_per_step``: wall seconds per denoising step, the stand-in's copy not counted (median over ``--repeats``
  canvases of ``--steps`` steps; the adaptive stopping is off so that every step runs);
- ``cpu_seconds_per_step``: the same in CPU seconds of the process (all its threads; steadier on a shared machine);
- ``peak_rss_gb``: the process's peak resident memory during the timed canvases, above what it held before them
  (``ru_maxrss``; the stand-in's logits, ``rows`` slabs, are part of it);
- ``peak_full_vocab_f32_slabs``: the most float32 tensors of last dimension ``vocab`` alive at once, in `(canvas,
  vocab)` slabs (a row's logits is one), counted with a ``TorchDispatchMode`` over one more canvas (the stand-in's
  output and the previous step's self-conditioning input included); ``peak_new_gb``: all bytes created and alive at
  once over that canvas.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Counts the storages the ops under it create and how many are alive at once: ``peak_bytes`` (all of them) and
    ``peak_slabs`` (float32 storages of tensors whose last dimension is ``vocab``, in units of ``slab`` bytes). A
    storage is alive while a tensor the mode saw on it is (a view keeps its storage)."""

    def __init__(self, vocab: int, slab: int):
        super().__init__()
        self.vocab, self.slab = vocab, slab
        self.storages: dict[int, list] = {}  # data pointer -> [bytes, full-vocab float32, tensors alive]
        self.seen: set[int] = set()
        self.bytes = self.slabs = self.peak_bytes = self.peak_slabs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.seen:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if not key or not size:
            return
        entry = self.storages.get(key)
        if entry is None:
            full = t.dtype == torch.float32 and t.dim() > 0 and t.size(-1) == self.vocab
            entry = self.storages[key] = [size, full, 0]
            self.bytes += size
            self.slabs += size / self.slab if full else 0
            self.peak_bytes, self.peak_slabs = max(self.peak_bytes, self.bytes), max(self.peak_slabs, self.slabs)
        entry[2] += 1
        self.seen.add(id(t))
        weakref.finalize(t, self._release, key, id(t))

    def _release(self, key: int, ident: int) -> None:
        self.seen.discard(ident)
        entry = self.storages[key]
        entry[2] -= 1
        if entry[2] == 0:
            del self.storages[key]
            self.bytes -= entry[0]
            self.slabs -= entry[0] / self.slab if entry[1] else 0


class StandIn:
    """The model's place in ``_Sampler.denoise``: fresh float32 logits each call, its own time recorded."""

    def __init__(self, rows: int, canvas: int, vocab: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(rows, canvas, vocab, generator=g).mul_(0.3).tanh_().mul_(30.0)  # in place: no peak
        self.dtype, self.seconds, self.cpu_seconds, self.calls = dtype, 0.0, 0.0, 0

    def __call__(self, cache, visible, canvas_ids, canvas_positions, self_conditioning=None):
        start, cpu = time.perf_counter(), time.process_time()
        out = self.logits.clone()
        self.seconds, self.calls = self.seconds + time.perf_counter() - start, self.calls + 1
        self.cpu_seconds += time.process_time() - cpu
        return out


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(rows: int = 1, steps: int = 3, repeats: int = 3, vocab: int = 262144, canvas: int = 256,
        dtype: str = "float32") -> dict:  # fmt: skip
    from trl_dllm.models.families import diffusion_gemma as dg
    from trl_dllm.models.families.diffusion_gemma.sampling import _Sampler, diffusion_gemma_options

    model = dg.build_tiny_model()
    model.generation_config.stability_threshold = None  # every step runs: no adaptive stopping
    options = diffusion_gemma_options(model, gen_length=model.config.canvas_length, diffusion_steps=steps,
                                      eos_token_ids=dg.GENERATION_EOS_IDS)  # fmt: skip
    sampler = _Sampler(model, options)
    sampler.canvas_length, sampler.vocab_size = canvas, vocab
    stand_in = StandIn(rows, canvas, vocab, getattr(torch, dtype))
    visible = torch.ones(rows, 4, dtype=torch.bool)
    positions = torch.arange(canvas).expand(rows, canvas) + 4
    running = torch.ones(rows, dtype=torch.bool)

    def canvas_once(seed: int):
        generators = [torch.Generator().manual_seed(seed + b) for b in range(rows)]
        return sampler.denoise(stand_in, None, visible, positions, running, list(range(rows)), generators)

    with torch.no_grad():
        canvas_once(0)  # warm-up
        before, times, cpu_times = _rss_bytes(), [], []
        for r in range(repeats):
            stand_in.seconds, stand_in.cpu_seconds, stand_in.calls = 0.0, 0.0, 0
            start, cpu = time.perf_counter(), time.process_time()
            canvas_once(r + 1)
            times.append((time.perf_counter() - start - stand_in.seconds) / stand_in.calls)
            cpu_times.append((time.process_time() - cpu - stand_in.cpu_seconds) / stand_in.calls)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        slab = canvas * vocab * 4
        with LiveTensors(vocab, slab) as live:
            canvas_once(1)
    times.sort()
    cpu_times.sort()
    return {
        "rows": rows, "canvas": canvas, "vocab": vocab, "steps": steps, "self_conditioning_dtype": dtype,
        "threads": torch.get_num_threads(), "loadavg_1min": round(os.getloadavg()[0], 2),
        "seconds_per_step": round(times[len(times) // 2], 3),
        "seconds_per_step_all": [round(t, 3) for t in times],
        "cpu_seconds_per_step": round(cpu_times[len(cpu_times) // 2], 3),
        "peak_rss_gb": round(peak_rss / 1e9, 3),
        "peak_full_vocab_f32_slabs": round(live.peak_slabs, 3),
        "slab_gb": round(slab / 1e9, 3),
        "peak_new_gb": round(live.peak_bytes / 1e9, 3),
    }  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.rows, args.steps, args.repeats, args.vocab, args.canvas, args.dtype)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"diffusion_gemma_sampler_{args.dtype}_{args.rows}.json").write_text(text + "\n")
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
