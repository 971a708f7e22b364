"""`trl-dllm plan` on every 8B recipe, with config-only folders of the released shapes (no weights), and its errors."""

import json
import re
from pathlib import Path

import pytest

from trl_dllm.cli import main
from trl_dllm.models.tiny_families import released_original_config
from trl_dllm.planning import embedded_config

RECIPES = {
    "llada": "recipes/llada/stabledrl_gsm8k_lora.yaml",
    "dream": "recipes/dream/stabledrl_gsm8k.yaml",
    "sdar": "recipes/sdar/stabledrl_gsm8k.yaml",
    "llada2": "recipes/llada2/stabledrl_gsm8k_lora.yaml",
    "llada_moe": "recipes/llada_moe/stabledrl_gsm8k_lora.yaml",
}


@pytest.fixture(scope="module")
def config_folders(tmp_path_factory):
    """`{family: folder}` holding only the released checkpoint's config.json."""
    folders = {}
    for family in RECIPES:
        folder = tmp_path_factory.mktemp(f"{family}-config")
        (folder / "config.json").write_text(json.dumps(released_original_config(family)))
        folders[family] = str(folder)
    return folders


def run(capsys, *argv):
    status = main(["plan", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("family", list(RECIPES))
def test_plan_json_on_each_8b_recipe(family, config_folders, capsys):
    status, out, _ = run(capsys, "--config", RECIPES[family], "--model_name_or_path", config_folders[family],
                         "--num_processes", "8", "--json")  # fmt: skip
    assert status == 0
    report = json.loads(out)
    assert report["model"]["family"] == family
    assert report["total_gb"] > report["phases"]["weights"] > 0
    assert report["fits"] == (report["total_gb"] <= report["usable_gb"])
    assert report["largest_batch"] >= (report["per_device_train_batch_size"] if report["fits"] else 0)
    assert set(report["strategies"]) == {"ddp", "zero2", "zero3", "fsdp2"}
    if not report["fits"]:
        assert report["suggestions"] and any(s["fits"] for s in report["suggestions"])


def test_plan_table_and_flags(config_folders, capsys):
    status, out, _ = run(capsys, "--config", RECIPES["llada"], "--model_name_or_path", config_folders["llada"],
                         "--activation_checkpointing", "true", "--per_device_train_batch_size", "8",
                         "--num_generations", "8")  # fmt: skip
    assert status == 0
    assert "batch 8, activation checkpointing on" in out and "peak (" in out and "fits in 72.0 GB usable" in out


def test_plan_suggests_changes_when_it_does_not_fit(config_folders, capsys):
    status, out, _ = run(capsys, "--config", RECIPES["llada"], "--model_name_or_path", config_folders["llada"],
                         "--activation_checkpointing", "false", "--logits", "full", "--mc_checkpointing", "false",
                         "--json")  # fmt: skip
    report = json.loads(out)
    assert status == 0 and not report["fits"]
    changes = [s["change"] for s in report["suggestions"] if s["fits"]]
    assert {"activation_checkpointing": True} in changes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "zero4"], "strategy: 'zero4' is not one of ddp, zero2, zero3, fsdp2"),
        (["--logits", "some"], "logits: 'some' must be chunked or full"),
        (["--model_name_or_path", "nobody/no-such-model"], "only its config.json"),
        (["--model_name_or_path", "/no/such/folder"], "model_name_or_path: no such directory: /no/such/folder"),
        (["--usable_fraction", "1.5"], "usable_fraction: 1.5 must be at most 1"),
    ],
)
def test_plan_bad_input_exits_2(argv, message, config_folders, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", RECIPES["llada"], "--model_name_or_path", config_folders["llada"], *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_plan_folder_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", RECIPES["llada"], "--model_name_or_path", str(tmp_path)])
    assert exit_info.value.code == 2 and "has no config.json" in capsys.readouterr().err


def test_plan_an_adapter_folder_names_its_base(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base", "r": 8}))
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", RECIPES["llada"], "--model_name_or_path", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "is a LoRA adapter" in err and "--model_name_or_path /models/base" in err


def test_choosing_md_quotes_the_planner(capsys):
    """docs/choosing.md's "Planning an 8B run": the table it quotes and the numbers in its comments are what its two
    blocks print now (the blocks themselves also run in tests/test_docs.py)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "choosing.md").read_text()
    section = text[text.index("## Planning an 8B run") : text.index("## Logging backends")]
    blocks = re.findall(r"<!-- doc: run -->\n```python\n(.*?)```", section, re.S)
    quoted = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(blocks[0], namespace)
    printed = re.sub(r"^\S+: (?=\d)", "", capsys.readouterr().out, flags=re.M)  # the temporary folder's name
    assert printed.strip() == quoted.strip()
    exec(blocks[1], namespace)
    assert capsys.readouterr().out.strip().splitlines() == re.findall(r"^# (\d+ [\d. ]+)$", blocks[1], re.M)


def test_plan_help_lists_its_options(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--gpu_memory_gb" in out and "--num_processes" in out and "--per_device_train_batch_size" in out


PAPER_RECIPES = sorted(p for p in Path("recipes").glob("*/*.yaml")
                       if p.parent.name in RECIPES and not p.name.startswith("vrpo_"))  # vrpo_: `trl-dllm dpo`, not planned


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_paper_recipe_fits_8_gpus_of_80gb_under_its_launch_config(recipe, config_folders, capsys):
    """Each 8B recipe, with the released model's shape and the accelerate config its header launches with, plans
    to fit 8 GPUs of 80 GB (what the README promises; `sdar/dipo_math` needed ZeRO-2 with a smaller micro-batch and
    rollout chunks, `llada2/stabledrl_gsm8k` rollout chunks)."""
    launch = re.search(r"--config_file recipes/accelerate/(\w+)\.yaml", recipe.read_text())
    assert launch, f"{recipe}: its header names no launch command"
    model = re.search(r"^model_name_or_path: (\S+)", recipe.read_text(), re.M).group(1)
    # a model whose config.json is embedded (LLaDA2.0 mini and flash) is planned by its name, else from the folder
    folder = [] if embedded_config(model) else ["--model_name_or_path", config_folders[recipe.parent.name]]
    status, out, _ = run(capsys, "--config", str(recipe), *folder, "--num_processes", "8", "--strategy",
                         launch.group(1), "--json")  # fmt: skip
    report = json.loads(out)
    assert status == 0 and report["fits"], (report["total_gb"], report["peak_phase"], report["suggestions"])


def test_a_smaller_batch_keeps_the_rollout_rows_and_chunks_them(config_folders, capsys):
    """A smaller per-device batch with more accumulation steps keeps the rows per rollout (TRL's steps_per_generation
    follows the accumulation), so where the rollout is the peak the suggestion bounds it with generation_chunk_size,
    and the suggestion, applied, plans what it said."""
    argv = ["--config", "recipes/sdar/dipo_math.yaml", "--model_name_or_path", config_folders["sdar"],
            "--num_processes", "8", "--strategy", "zero3", "--per_device_train_batch_size", "16",
            "--gradient_accumulation_steps", "8", "--generation_chunk_size", "None", "--json"]  # fmt: skip
    status, out, _ = run(capsys, *argv)
    report = json.loads(out)
    assert status == 0 and not report["fits"]
    fix = next(s for s in report["suggestions"] if s["fits"])
    assert fix["change"]["per_device_train_batch_size"] * fix["change"]["gradient_accumulation_steps"] == 128
    assert 128 % fix["change"]["generation_chunk_size"] == 0
    applied = list(argv)
    for field, value in fix["change"].items():
        if field == "accelerate_config":
            applied[applied.index("--strategy") + 1] = Path(value).stem
        else:
            applied += [f"--{field}", str(value)]
    status, out, _ = run(capsys, *applied)
    assert json.loads(out)["total_gb"] == pytest.approx(fix["total_gb"])


DIFFUSION_GEMMA_RECIPE = "recipes/diffusion_gemma/stabledrl_gsm8k_lora.yaml"


@pytest.fixture(scope="module")
def diffusion_gemma_folders(tmp_path_factory):
    """`(released, tiny)`: a folder holding only google/diffusiongemma-26B-A4B-it's config.json, and the tiny
    checkpoint of the tests."""
    from trl_dllm.models.families import diffusion_gemma

    released = tmp_path_factory.mktemp("diffusion-gemma-config")
    (released / "config.json").write_text(json.dumps(diffusion_gemma.released_config()))
    return str(released), diffusion_gemma.save_tiny(tmp_path_factory.mktemp("tiny-diffusion-gemma"))


def test_plan_diffusion_gemma_recipe(diffusion_gemma_folders, capsys):
    """The recipe (StableDRL's groups of 16, two corruptions) on the released shape under ZeRO-3 on 8 GPUs of 80 GB
    fits, its rollout of 8 rows at a time the peak (each row's denoising step holds ~1.7 GB of (C, V) tensors); without
    activation checkpointing (which also checkpoints the encoder pass, row by row) it does not."""
    status, out, _ = run(capsys, "--config", DIFFUSION_GEMMA_RECIPE, "--model_name_or_path", diffusion_gemma_folders[0],
                         "--num_processes", "8", "--strategy", "zero3", "--json")  # fmt: skip
    report = json.loads(out)
    assert status == 0 and report["model"]["family"] == "diffusion_gemma"
    assert report["model"]["trainable"] == 37_171_200 and report["logits"] == "full"
    assert report["fits"] and report["peak_phase"] == "rollout" and report["largest_batch"] >= 8
    assert report["per_device_train_batch_size"] == 16
    status, out, _ = run(capsys, "--config", DIFFUSION_GEMMA_RECIPE, "--model_name_or_path", diffusion_gemma_folders[0],
                         "--num_processes", "8", "--strategy", "zero3", "--json", "--activation_checkpointing", "false")  # fmt: skip
    off = json.loads(out)
    assert status == 0 and not off["fits"] and off["peak_phase"] == "update"


def test_a_rollout_chunk_too_large_for_any_batch_is_named_and_bounded(diffusion_gemma_folders, capsys):
    """The recipe with rollouts of 16 rows at a time: no batch fits, and the plan says it is the rollout of that chunk
    (not "largest batch 0") and proposes the smaller chunk that fits; it proposes nothing worse than the plan itself
    (ZeRO-2 plans more than ZeRO-3 here)."""
    argv = ["--config", DIFFUSION_GEMMA_RECIPE, "--model_name_or_path", diffusion_gemma_folders[0], "--num_processes",
            "8", "--strategy", "zero3", "--generation_chunk_size", "16"]  # fmt: skip
    status, out, _ = run(capsys, *argv, "--json")
    report = json.loads(out)
    assert status == 0 and not report["fits"] and report["largest_batch"] == 0
    assert report["batch_one"]["peak_phase"] == "rollout" and report["batch_one"]["total_gb"] > report["usable_gb"]
    assert all(fix["fits"] or fix["total_gb"] < report["total_gb"] for fix in report["suggestions"])
    assert {"change": {"generation_chunk_size": 8}, "total_gb": 66.69, "fits": True} in report["suggestions"]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "largest batch 0" not in out and "zero3 81.59 GB (no batch fits)" in out
    assert "no batch fits: batch 1 needs 81.59 GB, at its rollout of 16 rows at a time (generation_chunk_size=16)" in out
    assert "to fit: generation_chunk_size=8 -> 66.69 GB (fits)" in out


def test_plan_tiny_diffusion_gemma_prints_a_table(diffusion_gemma_folders, capsys):
    status, out, _ = run(capsys, "--config", DIFFUSION_GEMMA_RECIPE, "--model_name_or_path", diffusion_gemma_folders[1])
    assert status == 0 and "peak (update)" in out and "fits in 72.0 GB usable" in out


def test_plan_refuses_what_the_trainer_refuses_on_diffusion_gemma(diffusion_gemma_folders, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", DIFFUSION_GEMMA_RECIPE, "--model_name_or_path", diffusion_gemma_folders[1],
              "--estimator", "elbo"])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "estimator" in err and "There is no training run to plan." in err


def test_cli_md_quotes_the_diffusion_gemma_plan(tmp_path, monkeypatch, capsys):
    """docs/cli.md's DiffusionGemma plan: the table it quotes and the variants' numbers are what the commands print."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = text[text.index("### DiffusionGemma") : text.index("## `trl-dllm demo`")]
    setup = re.search(r'python -c "(.*?)"\n', section, re.S).group(1).replace("\\\n", "")
    command = re.search(r"\ntrl-dllm plan (.*?)\n```", section, re.S).group(1).replace("\\\n", "").split()
    quoted = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(setup, {})
    recipe = str(Path(__file__).resolve().parents[1] / command[1])
    argv = [command[0], recipe, *command[2:]]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and out.strip() == quoted.strip()
    variants = re.search(r"With `--activation_checkpointing false` the same command plans (.*?) GB \(largest batch "
                         r"(\d+): does not fit\); rollouts of 16 rows at a time \(`--generation_chunk_size 16`\), "
                         r"(.*?) GB \(does not fit\); with one corruption per canvas \(`--mc_samples 1`\), (.*?) GB "
                         r"\(largest batch (\d+)\)", " ".join(section.split()))  # fmt: skip
    for extra, total, largest, fits in ((["--activation_checkpointing", "false"], 1, 2, False),
                                        (["--generation_chunk_size", "16"], 3, None, False),
                                        (["--mc_samples", "1"], 4, 5, True)):  # fmt: skip
        report = json.loads(run(capsys, *argv, *extra, "--json")[1])
        assert report["total_gb"] == float(variants.group(total)) and report["fits"] == fits, extra
        assert largest is None or report["largest_batch"] == int(variants.group(largest)), extra


def test_plan_refuses_lora_under_zero3_with_several_forwards_as_the_trainer_does(config_folders, capsys, monkeypatch):
    """The README LoRA recipe (2 views, one per forward) under ZeRO-3 with a DeepSpeed before 0.19.8: the trainer
    refuses it (TRL's reentrant checkpointing for LoRA there; trl_dllm.training.model_checks.check_reentrant_forwards),
    so the plan does too; with the fix it names, it plans. With DeepSpeed 0.19.8 the trainer checkpoints without
    reentry and trains it: the plan plans it."""
    from trl_dllm.training import model_checks

    lora = ["--config", "recipes/llada/stabledrl_gsm8k_lora.yaml", "--model_name_or_path", config_folders["llada"],
            "--num_processes", "8", "--strategy", "zero3"]  # fmt: skip
    monkeypatch.setattr(model_checks, "deepspeed_version", lambda: "0.19.8")
    assert run(capsys, *lora)[0] == 0
    monkeypatch.setattr(model_checks, "deepspeed_version", lambda: "0.19.2")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *lora])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "scores each row in 2 forwards" in err and "set mc_batch_size=2" in err and "no training run to plan" in err
    status, out, _ = run(capsys, *lora, "--mc_batch_size", "2", "--json")
    assert status == 0 and json.loads(out)["fits"]
    status, _, _ = run(capsys, *lora[:-1], "zero2")  # the recipe's own launcher
    assert status == 0


FLASH_RECIPE = "recipes/llada2/stabledrl_gsm8k_flash_lora.yaml"


@pytest.fixture
def no_hub(monkeypatch):
    """Any config.json read from the Hub or a folder fails: what is planned comes from the embedded config."""
    from trl_dllm.models import native

    def refuse(*args, **kwargs):
        raise OSError("the test reads no config.json")

    monkeypatch.setattr(native, "read_config_dict", refuse)


def test_plan_llada2_flash_recipe_from_its_embedded_config(no_hub, capsys):
    """inclusionAI/LLaDA2.0-flash by its Hub id, without the Hub: the recipe (StableDRL's batch of 16, 2 views in one
    forward, activation checkpointing, LoRA off the routed experts) under ZeRO-3 on 8 × 80 GB fits, its update the
    peak (planned, not measured); with TRL's default gathering of the whole model for rollouts nothing fits, and the
    plan names the fix. Under ddp (the default headline) it proposes ZeRO-3."""
    argv = ["--config", FLASH_RECIPE, "--gpu_memory_gb", "80", "--num_processes", "8"]
    status, out, _ = run(capsys, *argv, "--strategy", "zero3", "--json")
    report = json.loads(out)
    assert status == 0 and report["model"] == {
        "name_or_path": "inclusionAI/LLaDA2.0-flash", "embedded_config": True, "family": "llada2",
        "kind": "block_causal", "parameters": 102_889_697_280,
        "active_parameters": 6_152_269_824, "trainable": 137_363_456}  # fmt: skip
    assert report["fits"] and report["peak_phase"] == "update" and report["total_gb"] == 56.97
    assert report["largest_batch"] == 29 and report["per_device_train_batch_size"] == 16
    assert report["phases"]["weights"] == 38.635 and report["phases"]["rollout_gathered_weights"] == 0
    assert report["ds3_gather_for_generation"] is False and report["activation_checkpointing"]
    status, out, _ = run(capsys, *argv, "--strategy", "zero3", "--ds3_gather_for_generation", "true", "--json")
    gathered = json.loads(out)
    assert status == 0 and not gathered["fits"] and gathered["largest_batch"] == 0
    assert gathered["batch_one"]["peak_phase"] == "rollout"
    assert gathered["suggestions"][0] == {"change": {"ds3_gather_for_generation": False}, "total_gb": 56.97,
                                          "fits": True}  # fmt: skip
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "peak (update)                          226.59   does NOT fit" in out
    assert "to fit: accelerate_config=recipes/accelerate/zero3.yaml -> 56.97 GB (fits)" in out
    status, out, _ = run(capsys, *argv, "--strategy", "zero3", "--model_name_or_path", "inclusionAI/LLaDA2.1-flash")
    assert status == 0 and "56.97   fits in 72.0 GB usable of 80.0" in out


def test_cli_md_quotes_the_llada2_flash_plan(no_hub, capsys):
    """docs/cli.md's LLaDA2.0-flash plan: the table it quotes is what its command prints."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    section = text[text.index("### LLaDA2.0-flash") : text.index("### DiffusionGemma")]
    command = re.search(r"\ntrl-dllm plan (.*?)\n```", section, re.S).group(1).replace("\\\n", "").split()
    quoted = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    status, out, _ = run(capsys, *command)
    assert status == 0 and out.strip() == quoted.strip()


@pytest.mark.parametrize("family", list(RECIPES))
def test_each_recipe_s_released_id_planned_without_the_hub(family, no_hub, capsys):
    """Each 8B recipe names its family's released Hub id (GSAI-ML/LLaDA-8B-Instruct, ...): planned from the embedded
    released config.json, offline, and the output says so."""
    status, out, _ = run(capsys, "--config", RECIPES[family], "--gpu_memory_gb", "80")
    first = out.splitlines()[0]
    assert status == 0 and "(its released config.json, embedded: no Hub read)" in first, out
    assert embedded_config(first.split(" (")[0]) is not None


def test_plan_refuses_a_block_length_the_block_diffusion_model_refuses(config_folders, capsys):
    """SDAR decodes in its own blocks of 4: the trainer refuses block_length=8 at construction
    (`training.model_checks.check_block_layout`), so the plan does too, with the trainer's message; the recipe's own
    block length plans."""
    argv = ["--config", RECIPES["sdar"], "--model_name_or_path", config_folders["sdar"]]
    assert run(capsys, *argv, "--json")[0] == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv, "--block_length", "8"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "block_length=8 does not match the model's block size 4" in err and "no training run to plan" in err
