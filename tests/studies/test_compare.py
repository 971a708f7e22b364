"""`trl-dllm compare` shortened (`--quick`): every method from one warm start per task, equal budgets, the SFT row,
and the files it writes, on the bidirectional model and on its block-diffusion twin (`--model block`, with DiPO); plus
the selection parsing and the table's mean ± std."""

import json
import statistics
import sys
import types

import pytest
import torch
from transformers import AutoConfig

from studies.compare import (
    BLOCK_LENGTH,
    BLOCK_METHODS,
    METHODS,
    MODELS,
    SFT,
    SHORT_COMPARE,
    TASK_STEPS,
    CompareConfig,
    main,
    merge_compare,
    parse_args,
    perturb_weights,
)
from studies.compare_report import mean_std, merge_results, table_markdown
from trl_dllm import DiffusionGRPOConfig, cli
from trl_dllm.core.objectives import OBJECTIVES
from trl_dllm.demo.run import DemoConfig
from trl_dllm.demo.tasks import get_task

COMPARE_RUN = pytest.mark.slow  # the tests that read a `--quick` comparison (its runs take about 50 s): make test-slow


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `--quick` run of every method on every default task (a tiny model, 2 RL steps, seed 0)."""
    out = tmp_path_factory.mktemp("compare")
    return out, main(["--quick", "--out", str(out)])


@pytest.fixture(scope="module")
def quick_block(tmp_path_factory):
    """`--quick --model block` on `sort`: every block method, DiPO included, from one block-diffusion warm start."""
    out = tmp_path_factory.mktemp("compare_block")
    return out, main(["--quick", "--model", "block", "--tasks", "sort", "--out", str(out)])


@COMPARE_RUN
def test_quick_block_compares_dipo_from_a_block_warm_start(quick_block):
    out, results = quick_block
    assert results["config"]["model"] == "block" and tuple(results["config"]["methods"]) == tuple(BLOCK_METHODS)
    warm = AutoConfig.from_pretrained(out / "sort" / "warmstart")  # the checkpoint every run starts from
    assert (warm.dllm_family, warm.block_length) == ("block", BLOCK_LENGTH)
    ws = results["warm_starts"]["sort"]
    assert (ws["model"], ws["block_length"]) == ("block", BLOCK_LENGTH)
    runs = {r["method"]: r for r in results["runs"]}
    assert set(runs) == set(BLOCK_METHODS) and {r["seed"] for r in runs.values()} == {0}
    rl = [r for m, r in runs.items() if m != SFT]
    assert {(r["rollouts_per_step"], r["max_steps"], r["rollouts"], r["steps"]) for r in rl} == {(8, 2, 16, 2)}
    for method, run in runs.items():
        assert run["heldout_before"] == ws["heldout"]["reward"] and run["forwards"] > 0
        assert method == SFT or run["trainer_fields"] == BLOCK_METHODS[method]
    # DiPO's step-level likelihood is exact and on-policy: the old pass scores the rollout's own weights, ratio 1.
    dipo = runs["dipo"]["log"]
    assert dipo["ratio/max"] == pytest.approx([1.0, 1.0]) and dipo["ratio/min"] == pytest.approx([1.0, 1.0])
    assert runs[SFT]["forwards"] == runs[SFT]["steps"]  # one staircase forward per block-SFT step
    table = (out / "table.md").read_text()
    assert f"Warm start of the block-diffusion model (blocks of {BLOCK_LENGTH}): " in table
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:] == list(
        BLOCK_METHODS
    )


@COMPARE_RUN
def test_quick_writes_results_table_and_figure(quick):
    out, results = quick
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    assert (out / "compare.png").stat().st_size > 10_000
    runs = {(r["method"], r["task"], r["seed"]): r for r in results["runs"]}
    assert set(runs) == {(m, t, 0) for m in METHODS for t in CompareConfig().tasks}
    for run in runs.values():
        for key in ("heldout_before", "heldout_after", "heldout_last"):
            assert 0.0 <= run[key] <= 1.0, (key, run)
        assert run["heldout_before"] == results["warm_starts"][run["task"]]["heldout"]["reward"]  # same warm start
        assert run["curve"][0]["step"] == 0 and run["curve"][0]["test_reward"] == run["heldout_before"]
        assert run["best_step"] in [p["step"] for p in run["curve"][1:]]
        assert all(p["load1"] >= 0 and p["seconds"] >= 0 for p in run["curve"][1:])  # the load every evaluation saw
        assert run["forwards"] > 0 and run["wall_seconds"] > 0 and run["collapses"] >= 0
    table = (out / "table.md").read_text()
    assert table.startswith(f"Run {results['date']}: ") and f"{results['wall_minutes']:.1f} min in all" in table
    for task in CompareConfig().tasks:
        section = table.split(f"### {task}\n")[1].split("###")[0]
        demos = results["warm_starts"][task]["demonstrations"]  # exact imitation's held-out reward
        if get_task(task).verifier_only:
            assert demos < 0.5 and f"demonstrations themselves score {demos:.3f}" in section
        else:
            assert demos == 1.0 and "demonstrations" not in section
        assert [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")][1:] == list(
            METHODS
        )


@COMPARE_RUN
def test_quick_rl_methods_share_one_budget(quick):
    _, results = quick
    rl = [r for r in results["runs"] if r["method"] != SFT]
    assert {(r["rollouts_per_step"], r["max_steps"], r["max_minutes"]) for r in rl} == {(2 * 4, 2, 1.0)}
    assert {r["rollouts"] for r in rl} == {2 * 2 * 4} and {r["steps"] for r in rl} == {2}  # the cap did not bind
    assert {r["method"]: r["trainer_fields"] for r in rl} == {m: f for m, f in METHODS.items() if f is not None}


@COMPARE_RUN
def test_quick_sft_row_trains_as_long_as_the_longest_rl_run(quick):
    _, results = quick
    for task in CompareConfig().tasks:
        rl = [r for r in results["runs"] if r["task"] == task and r["method"] != SFT]
        (sft,) = [r for r in results["runs"] if r["task"] == task and r["method"] == SFT]
        assert sft["sft_budget_seconds"] == max(r["wall_seconds"] for r in rl)
        assert sft["rollouts"] == 0 and sft["sft_examples"] == sft["steps"] * DemoConfig().sft_batch_size
        assert sft["wall_seconds"] >= sft["sft_budget_seconds"] and sft["steps"] >= 1
        assert sft["forwards"] == sft["steps"]  # one forward per SFT step; evaluations are not counted


def test_every_shipped_objective_is_compared():
    loss_types = {f["loss_type"] for table in MODELS.values() for f in table.values() if f is not None}
    assert set(OBJECTIVES) <= loss_types and {"grpo", "bnpo"} <= loss_types  # dipo: on the block model
    assert METHODS["d1"]["estimator"] == "mean_field" and METHODS["d1"]["loss_type"] == "bnpo"
    assert BLOCK_METHODS["dipo"]["estimator"] == "block_steps" and "dipo" not in METHODS
    for table in MODELS.values():
        for fields in filter(None, table.values()):  # each passes the config checks
            DiffusionGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **fields)


def test_parse_args_selection():
    full = parse_args([])
    assert full.methods == tuple(METHODS) and full.seeds == (0, 1, 2)
    assert full.tasks == ("sort", "subset", "sort_shuffled")
    short = parse_args(["--short"])
    assert (short.methods, short.tasks, short.seeds, short.max_minutes) == tuple(
        SHORT_COMPARE[k] for k in ("methods", "tasks", "seeds", "max_minutes")
    )
    picked = parse_args(["--quick", "--methods", "d1", "sft", "d1", "--seeds", "3", "4", "--max-steps", "5"])
    assert (picked.methods, picked.seeds, picked.max_steps, picked.quick) == (("d1", "sft"), (3, 4), 5, True)
    assert full.model == "bidirectional" and parse_args(["--model", "block"]).methods == tuple(BLOCK_METHODS)
    block = parse_args(["--model", "block", "--short", "--methods", "dipo", "sft"])
    assert (block.model, block.methods, block.tasks, block.demo("subset").block_length) == (
        "block", ("dipo", "sft"), SHORT_COMPARE["tasks"], BLOCK_LENGTH
    )
    assert full.demo("sort").block_length is None
    with pytest.raises(ValueError, match=r"CompareConfig.methods has \['d1', .*\], not methods of model='block'"):
        CompareConfig(model="block")  # the default methods are the bidirectional model's


def test_roundoff_moves_weights_by_about_one_rounding_step():
    """`--roundoff K`: each weight times (1 + 2⁻²³ z): about half of a float32 model's weights move, each by at most a
    few rounding steps; the same (K, seed) moves them the same way, another K otherwise; 0 means none."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    base = [p.detach().clone() for p in model.parameters()]

    def perturbed(replicate, seed):
        copy = torch.nn.Linear(64, 64)
        copy.load_state_dict(model.state_dict())
        perturb_weights(copy, replicate, seed)
        return [p.detach() for p in copy.parameters()]

    once, again, other = perturbed(1, 4), perturbed(1, 4), perturbed(2, 4)
    moved = sum(int((a != b).sum()) for a, b in zip(once, base)) / sum(b.numel() for b in base)
    assert 0.3 < moved < 0.8
    for a, b in zip(once, base):
        ulp = torch.finfo(torch.float32).eps * b.abs()
        assert ((a - b).abs() <= 8 * ulp).all()
    assert all(torch.equal(a, b) for a, b in zip(once, again))
    assert not all(torch.equal(a, b) for a, b in zip(once, other))
    assert parse_args(["--roundoff", "2"]).roundoff == 2 and parse_args([]).roundoff == 0


def test_step_budget_is_per_task_unless_given():
    full = CompareConfig()
    assert (full.steps("sort"), full.steps("subset")) == (300, TASK_STEPS["subset"]) == (300, 600)
    assert full.steps("sort_shuffled") == 300  # sort's canvas, sort's budget
    assert full.demo("subset").max_steps == 600 and full.demo("sort").max_steps == 300
    assert CompareConfig(max_steps=50).steps("subset") == 50
    assert parse_args(["--short"]).steps("subset") == 300  # the documented --short numbers were measured at 300


def _split_by_task(results: dict, tmp_path) -> list[str]:
    """Write `results` as one output directory per task, started a minute apart, as parallel `--tasks` runs would."""
    dirs = []
    for offset, task in enumerate(results["config"]["tasks"]):
        part = json.loads(json.dumps(results))
        part["config"]["tasks"] = [task]
        part["runs"] = [r for r in part["runs"] if r["task"] == task]
        part["warm_starts"] = {task: part["warm_starts"][task]}
        part["date"] = f"2026-11-22T10:0{int(offset)}:00+00:00"
        part["wall_minutes"] = 10.0
        (tmp_path / task).mkdir()
        (tmp_path / task / "results.json").write_text(json.dumps(part))
        dirs.append(str(tmp_path / task))
    return dirs


@COMPARE_RUN
def test_merge_joins_per_task_runs(quick, tmp_path):
    _, results = quick
    dirs = _split_by_task(results, tmp_path)
    merged = main(["--merge", *dirs, "--out", str(tmp_path / "all")])
    assert merged["runs"] == json.loads(json.dumps(results["runs"]))
    tasks = list(CompareConfig().tasks)
    assert merged["config"]["tasks"] == tasks and merged["config"]["methods"] == list(METHODS)
    end = len(tasks) - 1 + 10.0  # the last part started len(tasks) - 1 minutes after the first and ran 10
    assert merged["date"] == "2026-11-22T10:00:00+00:00" and merged["wall_minutes"] == pytest.approx(end)
    assert [p["source"] for p in merged["merged_from"]] == dirs
    table = (tmp_path / "all" / "table.md").read_text()
    assert table.count("Merged: ") == len(tasks) and all(f"### {t}" in table for t in tasks)
    assert (tmp_path / "all" / "compare.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "all" / "results.json").read_text()) == json.loads(json.dumps(merged))


@COMPARE_RUN
def test_merge_refuses_a_run_twice_and_a_missing_directory(quick, tmp_path, capsys):
    _, results = quick
    part = json.loads(json.dumps(results)) | {"source": "a"}
    with pytest.raises(ValueError, match=r"\('d1', 'sort', 0, 0\) is in both 'a' and 'b'"):
        merge_results([part, part | {"source": "b"}])
    block = part | {"source": "b", "config": part["config"] | {"model": "block"}, "runs": []}
    with pytest.raises(ValueError, match="different models .*merge runs of one --model only"):
        merge_results([part, block])
    with pytest.raises(SystemExit) as exit_info:  # a flag error: one line, exit status 2
        main(["--merge", str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2 and "--merge " in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="--merge .*nowhere: no results.json there"):  # the API
        merge_compare((str(tmp_path / "nowhere"),), str(tmp_path / "out"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-minutes", "0"], "--max-minutes 0.0: must be > 0"),
        (["--methods", "ppo"], "invalid choice: 'ppo'"),
        (["--short", "--quick"], "not allowed with argument"),
        (["--merge", "a", "--quick"], "not allowed with argument"),
        (["--model", "block", "--methods", "d1", "dipo"], "--methods d1: not a method of --model block"),
        (["--methods", "dipo"], "--methods dipo: not a method of --model bidirectional"),
        (["--roundoff", "-1"], "--roundoff -1: a replicate number"),
    ],
)
def test_parse_args_refuses(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_table_is_mean_and_sample_std_over_seeds():
    assert mean_std([0.5]) == (0.5, None)
    assert mean_std([0.2, 0.4, 0.9]) == (pytest.approx(0.5), pytest.approx(statistics.stdev([0.2, 0.4, 0.9])))
    run = dict(method="d1", task="sort", heldout_before=0.4, heldout_last=0.5, best_step=10, steps=20, collapses=1,
               wall_seconds=3.0, forwards=7, rollouts_per_step=8, curve=[])  # fmt: skip
    results = {
        "config": {"tasks": ["sort"], "methods": ["d1"], "max_steps": 20, "max_minutes": 1.0},
        "warm_starts": {"sort": {"sft_steps": 40, "heldout": {"reward": 0.4}}},
        "runs": [{**run, "seed": 0, "heldout_after": 0.6}, {**run, "seed": 1, "heldout_after": 0.8}],
    }
    row = [line for line in table_markdown(results).splitlines() if line.startswith("| d1")][0]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "2" and cells[3] == "0.700 ± 0.141" and cells[4] == "0.300 ± 0.141" and cells[8] == "2"


def test_cli_forwards_compare_arguments(monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv=None: seen.append(argv))
    monkeypatch.setitem(sys.modules, "studies.compare", fake)
    assert cli.main(["compare", "--quick", "--seeds", "1"]) == 0
    assert seen == [["--quick", "--seeds", "1"]]


def _demonstration_scores(name: str) -> tuple[list[float], list[float]]:
    """The task's own reward of its `answer` column on the documented 4000 train and 256 test problems (seeded)."""
    task = get_task(name)
    train, test = task.problems("train", 4000, seed=0), task.problems("test", 256, seed=0, unique=True)
    return task.score([p["answer"] for p in train], train), task.score([p["answer"] for p in test], test)


def test_subset_demonstrations_score_as_documented():
    """docs/compare.md: the `subset` demonstrations, scored by the task's reward (seeded; no model involved)."""
    right, held_out = _demonstration_scores("subset")
    assert round(sum(r == 1.0 for r in right) / len(right), 3) == 0.179
    assert round(statistics.fmean(held_out), 3) == 0.451
    assert round(sum(r == 1.0 for r in held_out) / len(held_out), 3) == 0.18


def test_sort_shuffled_demonstrations_score_as_documented():
    """docs/compare.md: `sort_shuffled`'s demonstrations (the digits in a random order) scored by `sort`'s reward."""
    right, held_out = _demonstration_scores("sort_shuffled")
    assert round(statistics.fmean(right), 3) == 0.246 and round(sum(r == 1.0 for r in right) / len(right), 4) == 0.0045
    assert round(statistics.fmean(held_out), 3) == 0.264
    assert round(sum(r == 1.0 for r in held_out) / len(held_out), 3) == 0.012
