"""The lm-eval model (`trl_dllm.evaluation.harness`) on the embedded `tiny` model, offline, with two local tasks
(generate_until and multiple choice from JSONL written here): lm-eval's numbers equal a hand computation through
`trl_dllm.generate` and `trl_dllm.estimate`."""

import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from trl_dllm.evaluation.harness import DiffusionLM, request_seed, stop_at  # noqa: E402

DECODING = {"max_new_tokens": 8, "diffusion_steps": 4, "block_length": 8}
MC = {"mc_samples": 3, "mc_batch_size": 6}
GEN_PROMPTS = ["what is 1 + 2 ?", "sort 3 1 2", "add 4 and 5", "count the a"]
MC_DOCS = [
    {"question": "what is 1 + 2 ?", "choices": ["3", "4 5", "answer is 7"], "label": 0},
    {"question": "sort 2 1", "choices": ["1 2", "2 1"], "label": 1},
    {"question": "reverse a b c", "choices": ["c b a", "a b c", "b", "sum"], "label": 0},
]


@pytest.fixture(scope="module")
def lm():
    return DiffusionLM("tiny", batch_size=2, **DECODING, **MC)


@pytest.fixture(scope="module")
def reference():
    """The same weights, loaded by transformers alone (not through the harness)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_dllm.models.embedded import resolve_model_name

    path = resolve_model_name("tiny")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def hand_generate(model, tokenizer, prompt: str) -> str:
    """Greedy decoding of one prompt by `trl_dllm.generate`, cut at the first EOS and at the stop string '.'."""
    import trl_dllm

    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    eos = tokenizer.eos_token_id
    out = trl_dllm.generate(model, ids, torch.ones_like(ids), mask_token_id=tokenizer.mask_token_id, gen_length=8,
                            diffusion_steps=4, block_length=8, temperature=0.0, eos_token_ids=[eos])  # fmt: skip
    row = out.completion_ids[0].tolist()
    row = row[: row.index(eos)] if eos in row else row
    return stop_at(tokenizer.decode(row, skip_special_tokens=True), ["."])


def hand_loglikelihood(model, tokenizer, question: str, choice: str) -> float:
    """The antithetic ELBO estimate of `choice` given `question`, by `trl_dllm.estimate` with the request's seed."""
    import trl_dllm

    context = tokenizer.encode(question, add_special_tokens=False)
    continuation = tokenizer.encode(" " + choice, add_special_tokens=False)
    prompt, completion = torch.tensor([context]), torch.tensor([continuation])
    with torch.no_grad():
        out = trl_dllm.estimate("elbo", model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                                mask_token_id=tokenizer.mask_token_id, antithetic=True,
                                seeds=torch.tensor([request_seed(0, context, continuation)]), **MC)  # fmt: skip
    return float(out.logps.sum())


def write_tasks(folder, gen_targets):
    """A generate_until task and a multiple-choice task over local JSONL files, as lm-eval task YAMLs."""
    gen_file, mc_file = folder / "gen.jsonl", folder / "mc.jsonl"
    gen_file.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(GEN_PROMPTS, gen_targets)))
    mc_file.write_text("".join(json.dumps(doc) + "\n" for doc in MC_DOCS))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen_file}\noutput_type: generate_until\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['.']\n  do_sample: false\n  max_gen_toks: 8\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc_file}\noutput_type: multiple_choice\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, reference):
    """Task files whose generate targets are the hand-decoded texts for the first two prompts, wrong for the others
    (so exact_match is 0.5 exactly when the harness decodes as `trl_dllm.generate` does)."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    texts = [hand_generate(*reference, p) for p in GEN_PROMPTS]
    write_tasks(folder, [texts[0], texts[1], texts[2] + " x", texts[3] + " x"])
    return folder, texts


def test_generate_and_multiple_choice_equal_hand_computation(lm, reference, tasks):
    from lm_eval.tasks import TaskManager

    folder, texts = tasks
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_gen", "tiny_mc"], task_manager=TaskManager(
        include_path=str(folder), include_defaults=False), log_samples=True, bootstrap_iters=0)  # fmt: skip
    assert [s["filtered_resps"][0] for s in results["samples"]["tiny_gen"]] == texts
    assert results["results"]["tiny_gen"]["exact_match,none"] == 0.5

    hand = [[hand_loglikelihood(*reference, d["question"], c) for c in d["choices"]] for d in MC_DOCS]
    for sample in results["samples"]["tiny_mc"]:
        values = [resp[0] for resp in sample["filtered_resps"]]
        assert values == pytest.approx(hand[sample["doc_id"]], abs=1e-5)
    expected_acc = sum(max(range(len(h)), key=h.__getitem__) == d["label"] for h, d in zip(hand, MC_DOCS)) / 3
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(expected_acc)


@pytest.mark.slow  # lm-eval through the CLI in a subprocess (about 19 s)
def test_cli_runs_lm_eval_with_the_model_registered(tasks, tmp_path):
    from trl_dllm.cli import main

    folder, _ = tasks
    args = ",".join(f"{k}={v}" for k, v in {"pretrained": "tiny", **DECODING, **MC}.items())
    status = main(["lm-eval", "--model_args", args, "--tasks", "tiny_gen", "--include_path", str(folder),
                   "--output_path", str(tmp_path / "out")])  # fmt: skip
    assert status == 0
    (report,) = tmp_path.glob("out/**/results_*.json")
    assert json.loads(report.read_text())["results"]["tiny_gen"]["exact_match,none"] == 0.5


def test_sampled_generation_is_seeded_per_request(lm):
    """Temperature > 0: a prompt's completion does not depend on its batch or position in it."""
    kwargs = {"temperature": 1.0, "until": []}
    together = lm.generate_texts(GEN_PROMPTS[:2], kwargs)
    assert together == lm.generate_texts(GEN_PROMPTS[1::-1], kwargs)[::-1]
    assert together[1:] == lm.generate_texts(GEN_PROMPTS[1:2], kwargs)


def test_standard_error_is_that_of_the_mc_samples(lm, reference):
    """Standard error = std of the K per-sample estimates / sqrt(K); the estimate is their mean."""
    import trl_dllm

    model, tokenizer = reference
    context, continuation = tokenizer.encode("sort 3 1 2"), tokenizer.encode("1 2 3 and")
    value, stderr = lm.estimate_loglikelihood(context, continuation)
    prompt, completion = torch.tensor([context]), torch.tensor([continuation])
    out = trl_dllm.estimate("elbo", model, prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                            mask_token_id=tokenizer.mask_token_id, antithetic=True,
                            seeds=torch.tensor([request_seed(0, context, continuation)]), **MC)  # fmt: skip
    samples = out.sample_estimates[0].detach().double()
    assert value == pytest.approx(float(samples.mean()), abs=1e-5)
    assert stderr == pytest.approx(float(samples.std()) / math.sqrt(3), rel=1e-5)
    assert stderr > 0


def test_is_greedy_matches_greedy_decoding(lm, reference):
    """A continuation equal to the model's own greedy one-token-per-step decoding is greedy; a changed one is not."""
    import trl_dllm

    model, tokenizer = reference
    context = tokenizer.encode("add 4 and 5")
    ids = torch.tensor([context])
    out = trl_dllm.generate(model, ids, torch.ones_like(ids), mask_token_id=tokenizer.mask_token_id, gen_length=3,
                            diffusion_steps=3, block_length=3, temperature=0.0)  # fmt: skip
    greedy = out.completion_ids[0].tolist()
    assert lm.is_greedy(context, greedy)
    assert not lm.is_greedy(context, greedy[:2] + [(greedy[2] + 1) % 60 + 5])


def test_refusals(lm):
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling([])
    with pytest.raises(ValueError, match="repetition_penalty"):
        lm.generate_texts(["sort 1 2"], {"repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="block_length=3 must be a positive divisor"):
        DiffusionLM("tiny", max_new_tokens=8, block_length=3)
    with pytest.raises(ValueError, match="batch_size='auto'"):
        DiffusionLM("tiny", batch_size="auto")


def test_import_trl_dllm_does_not_import_lm_eval():
    import subprocess
    import sys

    code = "import sys, trl_dllm; trl_dllm.generate; print('lm_eval' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.slow
def test_two_processes_equal_one(lm, tasks, tmp_path):
    """`torchrun --nproc_per_node 2 -m trl_dllm lm-eval`: two ranks share the requests (lm-eval gathers them) and give
    the per-sample results of one process (noise is seeded per request)."""
    import os
    import subprocess

    from lm_eval.tasks import TaskManager

    from tests.test_multiprocess import ROOT, torchrun

    folder, _ = tasks
    args = ",".join(f"{k}={v}" for k, v in {"pretrained": "tiny", **DECODING, **MC}.items())
    command = [*torchrun(2), "-m", "trl_dllm", "lm-eval", "--model_args", args, "--tasks", "tiny_gen", "tiny_mc",
               "--include_path", str(folder), "--output_path", str(tmp_path), "--log_samples"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Building contexts for tiny_mc on rank 1" in result.stderr

    single = lm_eval.simple_evaluate(model=lm, tasks=["tiny_gen", "tiny_mc"], task_manager=TaskManager(
        include_path=str(folder), include_defaults=False), log_samples=True)  # fmt: skip
    for task in ("tiny_gen", "tiny_mc"):
        (samples_file,) = tmp_path.glob(f"**/samples_{task}_*.jsonl")
        two = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
        one = sorted(single["samples"][task], key=lambda s: s["doc_id"])
        for a, b in zip(one, two, strict=True):
            if task == "tiny_gen":
                assert a["filtered_resps"] == b["filtered_resps"]
            else:
                assert [r[0] for r in a["filtered_resps"]] == pytest.approx(
                    [float(r[0]) for r in b["filtered_resps"]], abs=1e-5
                )


def test_block_diffusion_model():
    """`tiny-block`: decoded in its native blocks of 4 with its KV cache, scored by the block estimator; continuations
    that are not whole blocks are refused for loglikelihood."""
    import trl_dllm

    lm = DiffusionLM("tiny-block", max_new_tokens=8, **MC)
    assert lm.estimator == "block" and lm.config.block_length == 4
    context, continuation = lm.tok_encode("sort 3 1 2"), lm.tok_encode("1 2 3 and")
    prompt, completion = torch.tensor([context]), torch.tensor([continuation])
    with torch.no_grad():
        hand = trl_dllm.estimate("block", lm.model, prompt, torch.ones_like(prompt), completion,
                                 torch.ones_like(completion), mask_token_id=lm.spec.mask_token_id, antithetic=True,
                                 block_length=4, seeds=torch.tensor([request_seed(0, context, continuation)]), **MC)  # fmt: skip
    assert lm.estimate_loglikelihood(context, continuation)[0] == pytest.approx(float(hand.logps.sum()), abs=1e-5)
    with pytest.raises(ValueError, match="multiple of 4 tokens"):
        lm.estimate_loglikelihood(context, continuation[:3])

    with torch.no_grad():
        out = trl_dllm.generate(lm.model, prompt, torch.ones_like(prompt), mask_token_id=lm.spec.mask_token_id,
                                gen_length=8, diffusion_steps=4, temperature=0.0, eos_token_ids=lm.eos)  # fmt: skip
    row = out.completion_ids[0].tolist()
    row = row[: min([row.index(e) for e in lm.eos if e in row], default=len(row))]
    expected = lm.tokenizer.decode(row, skip_special_tokens=True)
    assert lm.generate_texts(["sort 3 1 2"], {"until": []}) == [expected]
