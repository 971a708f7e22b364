"""The demo end to end, shortened: a tiny model, a few RL steps; it must write the figure and the summary."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from studies.tracking import canvas_logits
from trl_dllm.core.sampling import BlockCausalOptions, generate_block_causal
from trl_dllm.demo import main, parse_args
from trl_dllm.demo.run import QUICK, ROLLOUTS, DemoConfig, demo_trainer_args
from trl_dllm.demo.tasks import TASKS
from trl_dllm.demo.warmstart import (
    block_sft_loss,
    decode_completions,
    diffusion_sft_loss,
    encode_examples,
    greedy_eval,
    prepare,
    warm_start,
)
from trl_dllm.models import model_logits_fn, resolve_model_spec
from trl_dllm.testing import build_tiny_block_model, build_tiny_model, build_tokenizer


def test_quick_demo_writes_png_and_summary(tmp_path, capsys):
    summary = main(["--quick", "--out", str(tmp_path)])
    # Not a terminal here: rich draws no bar, so one plain line per evaluation says where the run is, never "nan".
    out = capsys.readouterr().out
    assert "warm start: " in out and "step 3/3, rollout reward " in out and "nan" not in out, out
    closing = out.splitlines()[-3:]  # unwrapped, and saying which reward is which
    assert closing[0].startswith("Held-out (test, greedy) reward ") and "best val reward (step " in closing[0], out
    assert closing[1].startswith("At the last step (3) the test reward was ") and "rollout reward" in closing[1], out
    assert (tmp_path / "reward.png").stat().st_size > 10_000
    written = json.loads((tmp_path / "summary.json").read_text())
    for key in ("heldout_reward_before", "heldout_reward_after", "train_steps", "wall_minutes"):
        assert key in written, key
    assert written["train_steps"] == summary["train_steps"] == 3
    assert 0.0 <= written["heldout_reward_before"] <= 1.0 and 0.0 <= written["heldout_reward_after"] <= 1.0
    assert [p["step"] for p in written["curve"]] == [0, 1, 2, 3]
    assert (tmp_path / "best_model" / "config.json").exists()


@pytest.mark.parametrize("task", ["add", "countdown"])
def test_quick_demo_runs_the_other_tasks(tmp_path, task):
    summary = main(["--quick", "--task", task, "--out", str(tmp_path)])
    assert summary["task"] == task and summary["train_steps"] == 3 and (tmp_path / "reward.png").exists()


def test_warm_start_is_seeded_and_lowers_the_loss():
    tokenizer = build_tokenizer(("countdown", "to"))
    prompts, answers = ["sort 3 1 2 ="] * 8, ["1 2 3"] * 8

    def run(seed):
        model = build_tiny_model(tokenizer, seed=0)
        return warm_start(model, tokenizer, prompts, answers, completion_length=4, steps=30, batch_size=8, seed=seed)

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    assert sum(first[-5:]) < sum(first[:5])


def test_block_warm_start_trains_in_the_block_layout():
    """A block-diffusion model warm-starts on the staircase block ELBO of its own layout (`block_sft_loss`), not on the
    bidirectional loss: the two differ on the same batch and generator, and the block loss falls with training."""
    tokenizer = build_tokenizer()
    prompts, answers = ["sort 3 1 2 =", "sort 2 1 ="] * 4, ["1 2 3", "1 2"] * 4
    model = build_tiny_block_model(tokenizer, 4, seed=0)
    spec = resolve_model_spec(model, tokenizer)
    batch, rows = encode_examples(tokenizer, prompts, answers, completion_length=8), torch.arange(8)
    logits_fn = model_logits_fn(model, spec)
    generator = torch.Generator().manual_seed(0)
    block_loss = block_sft_loss(logits_fn, batch, rows, spec.mask_token_id, generator, spec=spec)
    bidirectional = diffusion_sft_loss(logits_fn, batch, rows, spec.mask_token_id, torch.Generator().manual_seed(0))
    assert block_loss.item() > 0 and block_loss.item() != pytest.approx(bidirectional.item())
    losses = warm_start(model, tokenizer, prompts, answers, completion_length=8, steps=30, batch_size=8, seed=0)
    assert sum(losses[-5:]) < sum(losses[:5]) and model.config.dllm_family == "block"


def test_block_model_eval_decodes_block_by_block(tmp_path):
    """`greedy_eval` of a block-diffusion warm start is the block-causal sampler's greedy decode (here uncached, from a
    logits function) scored by the task; `canvas_logits` (the drift) is block-causal: a token in a later block leaves
    earlier blocks' logits alone, where the bidirectional model's move."""
    prep = prepare(replace(DemoConfig(out_dir=str(tmp_path), block_length=4), **QUICK))
    model = AutoModelForCausalLM.from_pretrained(prep["path"])
    tokenizer, task, test = prep["tokenizer"], prep["task"], prep["test"]
    spec = resolve_model_spec(model, tokenizer)
    assert (spec.family, spec.block_length) == ("block", 4)
    enc = tokenizer([p["prompt"] for p in test], add_special_tokens=False, padding=True, padding_side="left",
                    return_tensors="pt")  # fmt: skip
    options = BlockCausalOptions(mask_token_id=spec.mask_token_id, gen_length=8, diffusion_steps=8, block_length=4,
                                 use_cache=False)  # fmt: skip
    out = generate_block_causal(model_logits_fn(model, spec), enc["input_ids"], enc["attention_mask"], options=options)
    rewards = task.score(decode_completions(tokenizer, out.completion_ids), test)
    reward = greedy_eval(model, tokenizer, task, test)["reward"]
    assert reward == sum(rewards) / len(rewards) == prep["before"]["reward"]

    ids = tokenizer(["sort 3 1 2 = 1 2 3 [EOS] [EOS]"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    changed = ids.clone()
    changed[0, -1] = tokenizer.convert_tokens_to_ids("7")  # position 9: block 2; positions 4-7 are block 1
    mask = torch.ones_like(ids)
    for net, moves in ((model, False), (build_tiny_model(tokenizer, hidden_size=32, num_layers=2), True)):
        net_spec = resolve_model_spec(net, tokenizer)
        before, after = (canvas_logits(net, net_spec, x, mask, 6)[0, :4] for x in (ids, changed))  # columns 4-7
        assert (not torch.allclose(before, after)) == moves


def test_encode_examples_fills_with_eos_and_left_pads():
    tokenizer = build_tokenizer()
    batch = encode_examples(tokenizer, ["sort 2 1 =", "sort 3 2 1 ="], ["1 2", "1 2 3"], completion_length=4)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert batch.prompt_length == 5
    assert batch.input_ids[0, 0].item() == pad and batch.attention_mask[0, 0].item() == 0
    assert batch.input_ids[0, 5:].tolist()[2:] == [eos, eos]
    with pytest.raises(ValueError, match="EOS"):
        encode_examples(tokenizer, ["sort 3 2 1 ="], ["1 2 3 4"], completion_length=4)


def test_decode_cuts_after_first_eos_like_trl():
    tokenizer = build_tokenizer()
    ids = tokenizer("1 2 [EOS] 3 [EOS]", add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert decode_completions(tokenizer, ids) == ["1 2"]


def test_heldout_eval_is_deterministic(tmp_path):
    prep = prepare(replace(DemoConfig(out_dir=str(tmp_path)), **QUICK))
    model = AutoModelForCausalLM.from_pretrained(prep["path"])
    first = greedy_eval(model, prep["tokenizer"], prep["task"], prep["test"])
    assert first == greedy_eval(model, prep["tokenizer"], prep["task"], prep["test"]) == prep["before"]


def test_parse_args_defaults():
    args = parse_args([])
    assert (args.task, args.out, args.quick, args.rollout) == ("sort", "demo_out", False, "fixed")


def test_stability_flag_names_where_the_study_went(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--stability"])
    assert exc.value.code == 2 and "python -m studies.stability" in capsys.readouterr().err


def test_parse_rollout_settings():
    assert (parse_args([]).rollout, parse_args([]).rollout_threshold) == ("fixed", 0.7)
    args = parse_args(["--rollout", "threshold_cache", "--rollout-threshold", "0.5"])
    assert (args.rollout, args.rollout_threshold) == ("threshold_cache", 0.5)
    with pytest.raises(SystemExit):
        parse_args(["--rollout", "fast"])


def test_rollout_settings_reach_the_trainer_config_and_bad_ones_are_refused():
    task = TASKS["sort"]
    fields = {
        rollout: demo_trainer_args(DemoConfig(rollout=rollout, rollout_threshold=0.8), task, "unused")
        for rollout in ROLLOUTS
    }
    assert (fields["fixed"].confidence_threshold, fields["fixed"].generation_cache) == (None, "none")
    assert (fields["threshold"].confidence_threshold, fields["threshold"].generation_cache) == (0.8, "none")
    assert (fields["threshold_cache"].confidence_threshold, fields["threshold_cache"].generation_cache) == (
        0.8,
        "dual",
    )
    with pytest.raises(ValueError, match="DemoConfig.rollout='fast'"):
        demo_trainer_args(DemoConfig(rollout="fast"), task, "unused")
    with pytest.raises(ValueError, match="rollout_threshold=0.0 must be in"):
        demo_trainer_args(DemoConfig(rollout="threshold", rollout_threshold=0.0), task, "unused")


def test_quick_demo_with_each_rollout_setting_records_it_and_its_forwards(tmp_path):
    # The 5-step warm start is far from confident (at 0.05 no sampled token passed the threshold: as many forwards as
    # `fixed`); at 0.001 steps commit several tokens, so fewer forwards than `fixed`.
    summaries = {
        rollout: main(
            ["--quick", "--rollout", rollout, "--rollout-threshold", "0.001", "--out", str(tmp_path / rollout)]
        )
        for rollout in ROLLOUTS
    }
    rows, length = QUICK["prompts_per_step"] * QUICK["num_generations"], TASKS["sort"].completion_length
    for rollout, summary in summaries.items():
        written = json.loads((tmp_path / rollout / "summary.json").read_text())["rollout"]
        assert written == summary["rollout"] and written["setting"] == rollout
        assert summary["config"]["rollout"] == rollout and summary["train_steps"] == written["rollout_steps"] == 3
        per_step = [v for v in summary["train_log"]["generation/forwards_per_token"]]
        assert written["row_forwards"] == round(sum(v * rows * length for v in per_step))
        assert written["grad_norm_max"] >= written["grad_norm_median"] > 0 and written["ratio_max"] > 0
    fixed, threshold, cached = (summaries[r]["rollout"] for r in ROLLOUTS)
    assert (fixed["confidence_threshold"], fixed["generation_cache"]) == (None, "none")
    assert (threshold["confidence_threshold"], threshold["generation_cache"]) == (0.001, "none")
    assert (cached["confidence_threshold"], cached["generation_cache"]) == (0.001, "dual")
    assert fixed["forwards_per_token_mean"] == 1.0 and fixed["row_forwards"] == 3 * rows * length
    assert threshold["row_forwards"] < fixed["row_forwards"] and cached["row_forwards"] < fixed["row_forwards"]
