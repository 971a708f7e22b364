"""Shared pieces of the benchmarks: model sizes, the tiny model, forward timing, JSON output.

Not a script; see ``bench/run_all.py`` (``python -m bench.run_all``) and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import string
import time
import warnings
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import torch

from trl_dllm.testing import build_tiny_model, build_tokenizer, save_tiny_dllm


@dataclass(frozen=True)
class Size:
    """Model and batch size of a benchmark (a Llama with ``is_causal=False``, untied head)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    intermediate: int = 1024
    vocab: int = 2048  # padded with filler words: the LM head should cost what it costs in a real model (see docs)
    batch: int = 4
    prompt: int = 64
    completion: int = 192
    block: int = 32


DEFAULT = Size()
QUICK = Size(layers=1, hidden=32, heads=2, intermediate=64, vocab=512, batch=2, prompt=8, completion=32, block=8)


def filler_words(size: Size) -> list[str]:
    """Whole-word tokens ``qaaa, qaab, ...`` that bring the tokenizer's vocabulary to ``size.vocab`` entries."""
    base = len(build_tokenizer())
    return ["q" + "".join(p) for p in product(string.ascii_lowercase, repeat=3)][: max(0, size.vocab - base)]


def model_kwargs(size: Size) -> dict:
    return dict(
        hidden_size=size.hidden, num_layers=size.layers, num_heads=size.heads, intermediate_size=size.intermediate
    )


def build(size: Size, seed: int = 0):
    """``(tokenizer, model)``: the offline tokenizer padded to ``size.vocab`` and a random bidirectional Llama."""
    tokenizer = build_tokenizer(filler_words(size))
    return tokenizer, build_tiny_model(tokenizer, seed=seed, **model_kwargs(size))


REALISTIC_VOCABS = (32000, 126464)  # Llama-2 / Dream-sized, and LLaDA's vocabulary


def build_with_vocab(size: Size, vocab: int, seed: int = 0):
    """``(tokenizer, model)`` of :func:`build` with the model's vocabulary resized to ``vocab`` entries (the LM head
    grows to ``vocab × hidden``; the tokenizer keeps its ids, which are all below ``size.vocab``)."""
    tokenizer, model = build(size, seed=seed)
    torch.manual_seed(seed)  # the new rows are drawn from the global RNG
    model.resize_token_embeddings(vocab, mean_resizing=False)
    return tokenizer, model


def target(value: float, bound: float, what: str) -> dict:
    """``{"value", "target", "met"}`` of a ratio whose target is ``value <= bound`` (``what`` says what it is)."""
    return {"what": what, "value": value, "target": f"<= {bound}", "met": bool(value <= bound)}


def save(size: Size, path: str | os.PathLike) -> str:
    """:func:`trl_dllm.testing.save_tiny_dllm` at ``size`` (for the trainers, which load from a path)."""
    return save_tiny_dllm(path, extra_words=filler_words(size), **model_kwargs(size))


def random_ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Random ordinary tokens (ids 0-4 are the special tokens, mask included)."""
    return torch.randint(5, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def likelihood_inputs(size: Size, mask_token_id: int) -> dict:
    """Estimator inputs of ``size``: random prompts and completions, every position real and scored."""
    return {
        "prompt_ids": random_ids(size.batch, size.prompt, size.vocab, seed=0),
        "prompt_mask": torch.ones(size.batch, size.prompt, dtype=torch.long),
        "completion_ids": random_ids(size.batch, size.completion, size.vocab, seed=1),
        "score_mask": torch.ones(size.batch, size.completion, dtype=torch.long),
        "mask_token_id": mask_token_id,
        "seeds": torch.arange(size.batch, dtype=torch.long),
    }


class ForwardTimer:
    """Counts the calls of ``module.forward`` and the wall and CPU time spent inside them (forward hooks, so it sees
    every call however the module is reached: a logits function, a trainer). Backward passes are not included.

    Calls are counted when they start: a forward recomputed in backward (``torch.utils.checkpoint``) stops once it has
    rebuilt what backward needs, at the LM head, and never returns — it counts as a call, its time is not measured."""

    def __init__(self, module: torch.nn.Module):
        self.reset()
        self._start = (0.0, 0.0)
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = (time.perf_counter(), time.process_time())
        self.calls += 1

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start[0]
        self.cpu_seconds += time.process_time() - self._start[1]

    def reset(self) -> ForwardTimer:
        self.calls, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        return self

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def timed(fn, *args, **kwargs) -> tuple[float, float, object]:
    """``(wall seconds, CPU seconds of this process, fn(*args, **kwargs))``. CPU time counts every thread of the
    process and not the time it waits for a core, so it is the steadier of the two on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu, out


@contextlib.contextmanager
def compiled_regions(build, functions=None):
    """While the block runs, the decoding loop's compiled regions (:func:`trl_dllm.core.sampling.graphs.compile_once`)
    are built by ``build(fn)`` in place of ``torch.compile``: for every function, or for those in ``functions`` only
    (the others compile as usual, and keep what they compiled). The process's own regions of the swapped functions
    are put back after."""
    from trl_dllm.core.sampling import graphs

    def take() -> dict:
        return {key: graphs._COMPILED.pop(key) for key in list(graphs._COMPILED)
                if functions is None or key[0] in functions}  # fmt: skip

    compile_region, saved = graphs._compile, take()
    graphs._compile = build if functions is None else lambda fn: (build if fn in functions else compile_region)(fn)
    try:
        yield
    finally:
        graphs._compile = compile_region
        take()
        graphs._COMPILED.update(saved)


def median(values) -> float:
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator > 0 else math.nan


def floor_ratios(runs: list[tuple[float, float, int]], floors: list[tuple[float, float]], count: float) -> dict:
    """Median wall time of ``runs`` and its ratios to ``count`` floors, in wall (``ratio``) and CPU time
    (``ratio_cpu``).

    ``floors`` is the chronological list of ``(wall, cpu)`` floor measurements and a run ``(wall, cpu, i)`` came
    between ``floors[i]`` and ``floors[i + 1]``: each run is divided by the mean of its two neighbours, then the median
    of the per-run ratios is taken. A shared machine changes speed from one second to the next (see
    docs/benchmarks.md), so only measurements adjacent in time are compared.
    """

    def per_run(k):
        return median(r[k] / (count * (floors[r[2]][k] + floors[r[2] + 1][k]) / 2) for r in runs)

    return {
        "wall_seconds": round(median(r[0] for r in runs), 4),
        "ratio": round(per_run(0), 3),
        "ratio_cpu": round(per_run(1), 3),
    }


def environment(size: Size) -> dict:
    """What a reader needs to compare two runs: date, versions, threads, machine load, sizes."""
    import transformers
    import trl

    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "size": asdict(size),
    }


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="directory to write <name>.json into")
    return p


def setup(args) -> Size:
    """Threads, quiet progress bars and warnings (the output is the JSON), and the size."""
    import datasets
    import transformers

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    return QUICK if args.quick else DEFAULT


def emit(name: str, result: dict, out_dir: str | os.PathLike | None = None) -> str:
    """Print ``result`` as JSON and write it to ``out_dir/<name>.json`` when given."""
    text = json.dumps(result, indent=2, sort_keys=False)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, f"{name}.json").write_text(text + "\n")
    print(text, flush=True)
    return text
