"""An lm-evaluation-harness model for any diffusion LM trl_dllm can load (LLaDA, Dream, SDAR / TraDo, tiny, ...).

    trl-dllm lm-eval --model_args pretrained=PATH,max_new_tokens=256,diffusion_steps=128 --tasks gsm8k
    lm_eval.simple_evaluate(model=DiffusionLM("PATH"), tasks=[...])     # or model="trl_dllm", model_args="..."

Importing this module registers :class:`DiffusionLM` in lm-eval's registry as ``trl_dllm`` (alias ``dllm``);
``import trl_dllm`` does not import it. The three request types:

- ``generate_until``: diffusion decoding exactly as the trainer decodes (:func:`trl_dllm.training.rollouts.decoding_plan`:
  canvas length, blocks, steps, remasking, threshold decoding, caches, temperature, top-k / top-p, guidance), the
  completion cut at its first EOS, then at ``max_gen_toks`` tokens, then at the first stop string (``until``).
- ``loglikelihood``: LLaDA's protocol, a Monte Carlo estimate of the ELBO of the continuation given the context
  (:func:`trl_dllm.estimate`, ``"elbo"`` — ``"block"`` on a block-diffusion model, for continuations of whole
  blocks only), antithetic pairs by default.
  It is an estimate: :attr:`DiffusionLM.loglikelihood_stderrs` holds the standard error of each one.
- ``loglikelihood_rolling`` (perplexity tasks) is refused: see :meth:`DiffusionLM.loglikelihood_rolling`.

Noise is seeded per request from its tokens and ``seed`` (:func:`request_seed`), so results do not depend on request
order, batching or the number of processes. Under ``accelerate launch`` / ``torchrun`` each process evaluates its
share of the requests and lm-eval gathers them, as with its own ``hf`` model.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from collections.abc import Sequence
from dataclasses import replace

import lm_eval.models  # noqa: F401  lm-eval's own models, registered lazily (an empty registry would skip them)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

logger = logging.getLogger(__name__)

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
"""The lm-eval ``gen_kwargs`` a request may carry; any other is refused (diffusion decoding has no such option)."""

def request_seed(seed: int, *token_lists: Sequence[int]) -> int:
    """The noise seed of one request: a CRC-32 of ``seed`` and its token ids (context, continuation)."""
    return zlib.crc32(json.dumps([int(seed), *[[int(t) for t in ids] for ids in token_lists]]).encode())


def stop_at(text: str, until: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any non-empty stop string of ``until``."""
    cuts = [text.find(stop) for stop in until if stop and stop in text]
    return text[: min(cuts)] if cuts else text


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
        return str(value).lower() in ("true", "1", "yes")
    raise ValueError(f"{name}={value!r} must be true or false.")


@register_model("trl_dllm", "dllm")
class DiffusionLM(TemplateLM):
    """lm-eval model of a masked diffusion LM (model arguments: ``--model_args key=value,...``).

    Args:
        pretrained (`str`): a model directory, Hub id, trainer checkpoint, LoRA adapter (merged into its base for
            evaluation) or embedded model name (``tiny``).
        batch_size (`int`, *optional*, defaults to `1`): prompts decoded together by ``generate_until``.
        device (`str`, *optional*): defaults to this process's accelerator device (`accelerate`), else CPU.
        dtype (`str`, *optional*, defaults to `"float32"`): ``from_pretrained`` dtype (``bfloat16``, ``auto``, ...).
        max_new_tokens (`int`, *optional*, defaults to `256`): the canvas length (`max_completion_length`); a request's
            ``max_gen_toks`` cuts the decoded text, it does not change the canvas.
        diffusion_steps, block_length, remasking, confidence_threshold, cfg_scale, generation_cache, block_kv_cache,
            eos_early_exit, top_k, top_p, min_p: decoding fields of `DiffusionGRPOConfig`, same defaults and checks.
        temperature (`float`, *optional*, defaults to `0.0`): greedy unless a request's ``gen_kwargs`` set one.
        mc_samples (`int`, *optional*, defaults to `64`): Monte Carlo samples per ``loglikelihood`` request (antithetic
            pairs: 128 masked views, LLaDA's 128 evaluations).
        mc_batch_size (`int`, *optional*, defaults to `32`): masked views per forward.
        antithetic (`bool`, *optional*, defaults to `True`): score each mask and its complement.
        check_greedy (`bool`, *optional*, defaults to `True`): compute ``is_greedy`` of a ``loglikelihood`` request by
            decoding the continuation greedily, one token per step (LLaDA's check; one forward per continuation token).
            `False` skips it and reports ``is_greedy=False`` (metrics built on it are then meaningless).
        seed (`int`, *optional*, defaults to `0`): the seed every request's noise is derived from.
        native_loading, trust_remote_code, mask_token_id: as in `DiffusionGRPOConfig`.
    """

    def __init__(self, pretrained, *, batch_size=1, max_batch_size=None, device=None, dtype="float32",
                 trust_remote_code=False, native_loading=True, mask_token_id=None, max_new_tokens=256,
                 diffusion_steps=None, block_length=None, remasking="low_confidence", confidence_threshold=None,
                 temperature=0.0, top_k=0, top_p=1.0, min_p=None, cfg_scale=0.0, generation_cache="none",
                 block_kv_cache=True, eos_early_exit=False, mc_samples=64, mc_batch_size=32, antithetic=True,
                 check_greedy=True, seed=0):  # fmt: skip
        super().__init__()
        from accelerate import PartialState

        # On a machine without CUDA, `cpu=True` is what makes accelerate join the processes of torchrun / accelerate
        # launch (gloo); without it every process would evaluate everything alone.
        state = PartialState(cpu=not torch.cuda.is_available() or str(device).startswith("cpu"))
        self._rank, self._world_size = state.process_index, state.num_processes
        self._device = self._pick_device(device, state)
        if str(batch_size) == "auto" or max_batch_size is not None:
            raise ValueError(
                f"batch_size={batch_size!r}, max_batch_size={max_batch_size!r}: the trl_dllm model takes a fixed "
                "batch_size (an integer, prompts decoded together) and no max_batch_size."
            )
        self.batch_size = self._positive("batch_size", batch_size)
        self.temperature, self.seed = float(temperature), int(seed)
        self.check_greedy = _flag("check_greedy", check_greedy)
        self.config = self._decoding_config(
            max_completion_length=int(max_new_tokens), diffusion_steps=diffusion_steps, block_length=block_length,
            remasking=remasking, confidence_threshold=confidence_threshold, top_k=int(top_k), top_p=float(top_p),
            min_p=min_p, cfg_scale=float(cfg_scale), generation_cache=generation_cache,
            block_kv_cache=_flag("block_kv_cache", block_kv_cache), eos_early_exit=_flag("eos_early_exit", eos_early_exit),
            native_loading=_flag("native_loading", native_loading), mask_token_id=mask_token_id,
            use_cpu=self._device.type == "cpu",
        )  # fmt: skip
        self._load(pretrained, dtype, _flag("trust_remote_code", trust_remote_code), block_length)
        estimator = self.spec.kind.default_estimator  # the kind's own: "block" on a block-diffusion model, else "elbo"
        self.estimator_options = {
            "mc_samples": self._positive("mc_samples", mc_samples),
            "mc_batch_size": self._positive("mc_batch_size", mc_batch_size),
            "antithetic": _flag("antithetic", antithetic),
            **({"block_length": self.spec.decoding_block_length(self.config.block_length)}
               if self.spec.kind.block_causal else {}),
        }
        self.estimator = estimator
        self.loglikelihood_stderrs: list[float] = []

    @staticmethod
    def _pick_device(device, state) -> torch.device:
        """This process's device under several processes (as lm-eval's ``hf``), else ``device``; lm-eval's CLI asks
        for ``cuda`` by default, which falls back to the CPU (with a warning) on a machine without CUDA."""
        if state.num_processes > 1 or not device:
            return state.device
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            logger.warning("device=%r: CUDA is not available, evaluating on the CPU.", device)
            return torch.device("cpu")
        return torch.device(device)

    @staticmethod
    def _positive(name: str, value) -> int:
        if int(value) < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
        return int(value)

    @staticmethod
    def _decoding_config(**fields):
        """A `DiffusionGRPOConfig` holding the decoding fields: its defaults are derived and its checks run."""
        from ..config import DiffusionGRPOConfig

        return DiffusionGRPOConfig(output_dir="lm_eval_unused", report_to="none", bf16=False, temperature=1.0,
                                   **{k: v for k, v in fields.items() if v is not None})  # fmt: skip

    def _load(self, pretrained, dtype: str, trust_remote_code: bool, block_length) -> None:
        """The model as `trl-dllm eval` loads it (natively, adapters merged), bidirectional, on this process's device.
        A block-diffusion model decodes in its own blocks (``block_length`` left unset takes them) and is scored by the
        ``block`` estimator."""
        from ..models import make_bidirectional, resolve_model_spec
        from ..models.loading import eos_ids, load_model_and_tokenizer
        from ..training.inputs import check_model_path
        from ..training.model_checks import check_block_layout, max_positions

        init = {"dtype": dtype, "trust_remote_code": trust_remote_code}
        model, self.tokenizer = load_model_and_tokenizer(check_model_path(str(pretrained)), init,
                                                         self.config.native_loading)  # fmt: skip
        self.model = model.to(self._device).eval()
        make_bidirectional(self.model)
        self.spec = resolve_model_spec(self.model, self.tokenizer, self.config.mask_token_id)
        if self.spec.kind.block_causal:
            self.config.estimator = self.spec.kind.default_estimator
        if self.spec.kind.own_block_size and block_length is None:
            self.config.block_length = self.spec.decoding_block_length(None)
        check_block_layout(self.config, self.spec)
        self.eos = eos_ids(self.tokenizer, self.spec)
        self.max_length = max_positions(self.model.config)

    # ------------------------------------------------------------------------------------------------ lm-eval hooks

    @property
    def eot_token_id(self) -> int:
        return self.eos[0]

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)  # fmt: skip

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        from accelerate.utils import gather

        return tensor if self.world_size <= 1 else gather(tensor)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=result, dst=dst)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Refused: rolling log-likelihood (perplexity tasks) sums a left-to-right model's exact token log-probs over
        sliding windows. A masked diffusion model has neither left-to-right token probabilities nor an exact
        likelihood, and an ELBO estimate per window would not be a perplexity comparable to anyone's."""
        raise NotImplementedError(
            "loglikelihood_rolling (perplexity tasks such as wikitext) is not supported by the trl_dllm model: a "
            "masked diffusion model has no exact left-to-right token log-probabilities, only a Monte Carlo ELBO of a "
            "continuation given its context. Use multiple-choice (loglikelihood) or generate_until tasks."
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """LLaDA's protocol per request: the ELBO estimate of the continuation given the context, and whether greedy
        decoding reproduces the continuation. Standard errors land in :attr:`loglikelihood_stderrs`."""
        results, self.loglikelihood_stderrs = [], []
        for (pair, context, continuation) in requests:
            value, stderr = self.estimate_loglikelihood(context, continuation)
            greedy = self.is_greedy(context, continuation) if self.check_greedy else False
            results.append((value, greedy))
            self.loglikelihood_stderrs.append(stderr)
            self.cache_hook.add_partial("loglikelihood", pair, (value, greedy))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their ``gen_kwargs``, ``batch_size`` prompts per decoding call."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            for start in range(0, len(indices), self.batch_size):
                rows = indices[start : start + self.batch_size]
                texts = self.generate_texts([requests[i].args[0] for i in rows], gen_kwargs)
                for i, text in zip(rows, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    # ------------------------------------------------------------------------------------------------ our methods

    def _fit(self, context: Sequence[int], length: int) -> list[int]:
        """The context, cut from the left so that context + ``length`` positions fit the model (as lm-eval's hf)."""
        if self.max_length is None or len(context) + length <= self.max_length:
            return list(context)
        keep = self.max_length - length
        if keep < 1:
            raise ValueError(f"A continuation / canvas of {length} tokens does not fit the model's {self.max_length}.")
        return list(context)[-keep:]

    @torch.no_grad()
    def estimate_loglikelihood(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[float, float]:
        """``(estimate, standard error)`` of ``log p(continuation | context)``: the ELBO Monte Carlo estimate of
        :func:`trl_dllm.estimate` with this model's estimator options and the request's seed; the standard error is
        ``std(sample estimates) / sqrt(K)`` over its ``K`` samples (NaN for ``K = 1``)."""
        from ..api import estimate

        block = self.estimator_options.get("block_length")
        if block and len(continuation) % block:
            raise ValueError(
                f"A continuation of {len(continuation)} tokens on a block-diffusion model with blocks of {block}: the "
                "block estimator scores whole blocks, and padding the last block would change what is estimated. "
                "loglikelihood on block-diffusion models is supported for continuations of a multiple of "
                f"{block} tokens only (generate_until tasks have no such limit)."
            )
        context = self._fit(context, len(continuation))
        prompt = torch.tensor([context], device=self._device)
        completion = torch.tensor([list(continuation)], device=self._device)
        seeds = torch.tensor([request_seed(self.seed, context, continuation)])
        out = estimate(self.estimator, self.model, prompt, torch.ones_like(prompt), completion,
                       torch.ones_like(completion), mask_token_id=self.spec.mask_token_id, seeds=seeds,
                       **self.estimator_options)  # fmt: skip
        samples = out.sample_estimates[0].double()
        stderr = float(samples.std() / math.sqrt(samples.numel())) if samples.numel() > 1 else math.nan
        return float(out.logps.sum()), stderr

    @torch.no_grad()
    def is_greedy(self, context: Sequence[int], continuation: Sequence[int]) -> bool:
        """Whether greedy decoding of ``len(continuation)`` masks after the context, one token per step, the most
        confident first (LLaDA's check), gives the continuation. A block-diffusion model decodes a canvas rounded up
        to whole blocks, its first ``len(continuation)`` tokens compared."""
        from ..api import generate

        length = len(continuation)
        if self.spec.kind.own_block_size:  # whole blocks of the model's own size
            block = self.spec.decoding_block_length(None)
            length = -(-length // block) * block
        context = self._fit(context, length)
        prompt = torch.tensor([context], device=self._device)
        out = generate(self.model, prompt, torch.ones_like(prompt), mask_token_id=self.spec.mask_token_id,
                       gen_length=length, diffusion_steps=length, block_length=length, temperature=0.0,
                       remasking="low_confidence")  # fmt: skip
        return out.completion_ids[0, : len(continuation)].tolist() == list(continuation)

    def sampling_options(self, gen_kwargs: dict) -> dict:
        """What a request's ``gen_kwargs`` change in the decoding options; unknown keys are refused."""
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(
                f"gen_kwargs {unknown} are not supported by diffusion decoding (trl_dllm takes {list(GEN_KWARGS)}); "
                "set the decoding fields in --model_args instead (diffusion_steps, block_length, remasking, ...)."
            )
        temperature = float(gen_kwargs.get("temperature", self.temperature))
        if gen_kwargs.get("do_sample") is False:
            temperature = 0.0
        options = {"temperature": temperature}
        if gen_kwargs.get("top_k"):
            options["top_k"] = int(gen_kwargs["top_k"])
        if gen_kwargs.get("top_p") is not None and float(gen_kwargs["top_p"]) < 1.0:
            options["top_p"] = float(gen_kwargs["top_p"])
        return options

    @torch.no_grad()
    def generate_texts(self, contexts: Sequence[str], gen_kwargs: dict) -> list[str]:
        """Decode ``contexts`` together (left-padded), each row with its own seeded noise; cut at EOS, then at
        ``max_gen_toks`` tokens, then at the stop strings ``until``."""
        from ..training.rollouts import decoding_plan

        overrides = self.sampling_options(gen_kwargs)
        canvas = self.config.max_completion_length
        max_tokens = int(gen_kwargs.get("max_gen_toks", canvas))
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        rows = [self._fit(self.tok_encode(text), canvas) for text in contexts]
        width, pad = max(len(r) for r in rows), self.tokenizer.pad_token_id
        pad = self.eos[0] if pad is None else pad
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self._device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self._device)
        generators = [torch.Generator(device=self._device).manual_seed(request_seed(self.seed, r)) for r in rows]
        plan = decoding_plan(self.model, self.spec, self.config, eos_token_ids=self.eos)
        out = replace(plan, options=replace(plan.options, **overrides))(input_ids, attention_mask, generators)
        texts = []
        for row in out.completion_ids.tolist():
            ends = [i for i, token in enumerate(row) if token in self.eos]
            row = row[: ends[0] if ends else len(row)][:max_tokens]
            texts.append(stop_at(self.tokenizer.decode(row, skip_special_tokens=True), until))
        return texts
