"""Every recipe parses into the CLI's dataclasses, states its source, and keeps the hyperparameters of that source."""

import json
import re
from pathlib import Path

import pytest
import yaml
from trl import get_peft_config

from trl_dllm.rewards import REWARD_FUNCS
from trl_dllm.scripts.grpo import make_parser
from trl_dllm.tasks import TASK_REWARDS, TASKS

ROOT = Path(__file__).resolve().parents[1]
ALL_RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")
DPO_RECIPES = [p for p in ALL_RECIPES if p.name.startswith("vrpo_")]  # `trl-dllm dpo` recipes
RECIPES = [p for p in ALL_RECIPES if p not in DPO_RECIPES]  # `trl-dllm grpo` recipes
ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
PAPER_RECIPES = [p for p in RECIPES if p.parent.name != "tiny"]
TASK_NAMES = ("gsm8k", "math", "countdown", "sudoku")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def parse(path: Path):
    # GPU recipes say bf16: true, which TrainingArguments refuses on a CPU-only machine; the flags override it.
    argv = ["--config", str(path), "--bf16", "false", "--use_cpu", "true", "--model_name_or_path", "org/model"]
    return make_parser().parse(argv)


def test_the_matrix_is_complete():
    names = {rel(p) for p in RECIPES}
    for algo in ("diffu_grpo", "espo", "stabledrl", "agrpo", "cjgrpo", "dtreerpo"):
        for task in TASK_NAMES:
            assert f"recipes/llada/{algo}_{task}.yaml" in names
    assert {"recipes/llada/stabledrl_gsm8k_lora.yaml", "recipes/llada/stabledrl_gsm8k_crn.yaml"} <= names
    assert {"recipes/llada/justgrpo_gsm8k.yaml", "recipes/llada/justgrpo_math.yaml"} <= names  # JustGRPO's two
    assert {f"recipes/llada/bgpo_{task}.yaml" for task in ("math", "countdown", "sudoku")} <= names  # BGPO's three
    assert {"recipes/dream/stabledrl_gsm8k.yaml", "recipes/sdar/stabledrl_gsm8k.yaml"} <= names
    assert "recipes/sdar/dipo_math.yaml" in names
    assert "recipes/llada2/ebpo_math.yaml" in names
    assert "recipes/llada/mdpo_math.yaml" in names  # MDPO's one released training configuration
    assert {p.name for p in ACCELERATE} >= {"ddp.yaml", "zero2.yaml", "zero3.yaml", "zero2_cpu.yaml", "zero3_cpu.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_recipe_parses(path):
    script_args, args, model_args = parse(path)
    assert script_args.task in TASKS
    for name in script_args.reward_funcs or TASK_REWARDS[script_args.task]:
        assert name in REWARD_FUNCS
    assert args.max_completion_length % args.block_length == 0
    if model_args.use_peft:
        assert get_peft_config(model_args) is not None


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=rel)
def test_paper_recipe_keeps_the_collapse_guard_warning(path):
    """Every paper recipe runs with the collapse guard in `warn` mode (the config's default: a warning changes no
    update); the tiny ones stop instead."""
    assert parse(path)[1].collapse_guard == "warn"


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=rel)
def test_paper_recipe_states_its_source(path):
    text = path.read_text()
    assert "# Source:" in text and "github.com/" in text
    assert f"--config {rel(path)}" in text  # the launch command


def test_dipo_recipe_holds_the_released_values():
    _, args, model_args = parse(ROOT / "recipes/sdar/dipo_math.yaml")
    assert (args.loss_type, args.estimator, args.epsilon, args.epsilon_high) == ("dipo", "block_steps", 0.2, 0.28)
    assert (args.block_length, args.confidence_threshold, args.temperature, args.top_k) == (4, 0.9, 1.0, 50)
    assert (args.learning_rate, args.beta, args.num_generations, args.dynamic_sampling) == (1e-6, 0.0, 8, True)
    assert args.diffusion_steps == args.max_completion_length  # 4 steps per block of 4
    assert not model_args.use_peft


def test_ebpo_recipe_holds_dares_values_and_names_their_origin():
    path = ROOT / "recipes/llada2/ebpo_math.yaml"
    _, args, model_args = parse(path)
    assert (args.loss_type, args.estimator, args.mc_samples, args.antithetic) == ("ebpo", "block", 16, False)
    assert (args.learning_rate, args.weight_decay, args.temperature, args.num_generations) == (5e-7, 0.01, 0.6, 8)
    assert (args.block_length, args.max_completion_length, args.diffusion_steps) == (32, 2048, 1024)
    assert (args.epsilon, args.epsilon_high, args.beta, args.num_iterations, args.max_grad_norm) == (0.2, 0.2, 0, 1, 1)
    # 128 completions per update on 8 processes, as DARE's 16 prompts x 8 rollouts
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * 8 == 16 * 8
    assert not model_args.use_peft
    # Every value line says where it came from: the paper gives none, so DARE's or ours.
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and line.split(":")[0] not in ("dtype", "task", "dataset_split",
                                                                            "loss_type", "bf16", "logging_steps",
                                                                            "save_strategy", "output_dir"):
            assert "#" in line or line.startswith("adam_beta2"), line


def test_sdar_recipe_is_block_diffusion():
    text = (ROOT / "recipes/sdar/stabledrl_gsm8k.yaml").read_text()
    assert "load natively" in text
    _, args, _ = parse(ROOT / "recipes/sdar/stabledrl_gsm8k.yaml")
    assert (args.estimator, args.block_length, args.cfg_scale) == ("block", 4, 0.0)


def fidelity_tables() -> list[tuple[str, list[tuple[str, object]]]]:
    """docs/recipes.md, section Fidelity: per table, the recipe pattern of its heading (with `{task}`) and its `match`
    rows as (field, value). A row is `| `field` | released | `ours (YAML)` | match | why |`; a `{task: value}`
    mapping gives one value per task."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    section = text[text.index("## Fidelity") : text.index("## Tiny recipes")]
    tables = []
    for block in re.split(r"^### ", section, flags=re.M)[1:]:
        pattern = re.search(r"`(recipes/llada/[^`]*\{task\}[^`]*)`", block.splitlines()[0]).group(1)
        rows = []
        for line in block.splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[3] == "match":
                rows.append((cells[0].strip("`"), yaml.safe_load(cells[2].strip("`"))))
        tables.append((pattern, rows))
    return tables


def recipe_value(parsed, field):
    for dataclass_ in parsed:  # script arguments, DiffusionGRPOConfig, ModelConfig
        if hasattr(dataclass_, field):
            value = getattr(dataclass_, field)
            return getattr(value, "value", value)  # enums (lr_scheduler_type) compare by their string
    raise AssertionError(f"no recipe field {field!r}")


def test_fidelity_tables_cover_every_algorithm():
    patterns = [pattern for pattern, _ in fidelity_tables()]
    algorithms = ("diffu_grpo", "espo", "stabledrl", "agrpo", "justgrpo", "bgpo", "cjgrpo", "mdpo", "dtreerpo")
    assert patterns == [f"recipes/llada/{algo}_{{task}}.yaml" for algo in algorithms]
    assert all(len(rows) >= 25 for _, rows in fidelity_tables())


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("pattern,rows", fidelity_tables(), ids=lambda value: value if isinstance(value, str) else "")
def test_fidelity_table(pattern, rows, task):
    """Every `match` field of docs/recipes.md's fidelity table holds the released value in the recipe."""
    path = ROOT / pattern.replace("{task}", task)
    if not path.exists():  # JustGRPO released GSM8K and MATH only (and code, which has no task here)
        released = {"recipes/llada/justgrpo_{task}.yaml": ("countdown", "sudoku"),  # BGPO: no GSM8K-only run
                    "recipes/llada/bgpo_{task}.yaml": ("gsm8k",),
                    "recipes/llada/mdpo_{task}.yaml": ("gsm8k", "countdown", "sudoku")}  # MDPO: math only  # fmt: skip
        assert task in released.get(pattern, ())
        return
    parsed = parse(path)
    for field, expected in rows:
        if isinstance(expected, dict):
            expected = expected[task]
        actual = recipe_value(parsed, field)
        if isinstance(expected, float) or isinstance(actual, float):
            assert actual == pytest.approx(expected, rel=1e-12), (field, actual, expected)
        else:
            assert actual == expected, (field, actual, expected)


def test_stabledrl_crn_differs_from_the_released_recipe_only_in_its_noise():
    def fields(name):
        return yaml.safe_load((ROOT / "recipes" / "llada" / name).read_text())

    faithful, ours = fields("stabledrl_gsm8k.yaml"), fields("stabledrl_gsm8k_crn.yaml")
    changed = {key for key in faithful.keys() | ours.keys() if faithful.get(key) != ours.get(key)}
    assert changed == {"independent_mc_noise", "output_dir"}
    assert (faithful["independent_mc_noise"], ours["independent_mc_noise"]) == (True, False)


@pytest.mark.parametrize("path", [p for p in PAPER_RECIPES if p.name.startswith("stabledrl")], ids=rel)
def test_stabledrl_hyperparameters(path):
    _, args, model_args = parse(path)
    assert (args.loss_type, args.stabledrl_clip_high, args.num_generations) == ("stabledrl", 5.0, 16)
    assert args.learning_rate in (1e-6, 2e-6)
    # DiffusionGemma samples with its own temperature schedule (1.0 keeps it), in one canvas of 256 (its canvas_length:
    # block_length is left unset, so the config's filled-in default is not read)
    assert args.temperature == (1.0 if path.parent.name == "diffusion_gemma" else 0.9)
    assert args.max_completion_length == 256
    if path.parent.name == "diffusion_gemma":
        assert ("block_length" in args.defaulted, args.diffusion_steps, args.estimator) == (True, 128, "uniform_block")
    elif path.parent.name != "sdar":  # SDAR decodes in its native blocks of 4
        assert (args.block_length, args.diffusion_steps) == (32, 128)
    assert model_args.use_peft == path.stem.removesuffix("_fast").endswith("_lora")


@pytest.mark.parametrize("path", [p for p in RECIPES if p.parent.name == "tiny"], ids=rel)
def test_tiny_recipe_sizes(path):
    text = path.read_text()
    # The embedded tiny model by default, another path from the environment; data from the repository.
    assert ("${TRL_DLLM_TINY_MODEL:-tiny}" in text or "${TRL_DLLM_TINY_BLOCK_MODEL:-tiny-block}" in text)
    assert "tests/fixtures/" in text
    _, args, _ = parse(path)
    assert (args.max_completion_length, args.block_length, args.diffusion_steps) == (8, 4, 4)
    assert args.max_steps == 2 and args.per_device_train_batch_size == args.num_generations in (2, 4, 8)
    assert args.use_cpu


@pytest.mark.parametrize("path", ACCELERATE, ids=rel)
def test_accelerate_config(path):
    config = yaml.safe_load(path.read_text())
    cpu = path.stem.endswith("_cpu")
    assert config["use_cpu"] is cpu
    assert config["num_processes"] == (2 if cpu else 8)
    if "zero" in path.stem:
        assert config["distributed_type"] == "DEEPSPEED"
        assert config["deepspeed_config"]["zero_stage"] == int(path.stem[4])
    if path.stem.startswith("zero3"):
        assert config["deepspeed_config"]["zero3_save_16bit_model"] is True


def test_docs_list_every_recipe():
    text = (ROOT / "docs" / "recipes.md").read_text()
    missing = [rel(p) for p in ALL_RECIPES + ACCELERATE if rel(p) not in text]
    assert not missing, f"docs/recipes.md does not list {missing}"


@pytest.mark.parametrize("path", [p for p in RECIPES if p.parent.name == "tiny"], ids=rel)
def test_tiny_recipe_gets_a_gradient(path, tmp_path, monkeypatch):
    """Each tiny recipe, run as shipped on its embedded model, gives some group reward spread, so a non-zero advantage
    and a non-zero gradient: a user's first run shows a trainer that learns."""
    from trl_dllm.scripts import grpo

    monkeypatch.chdir(ROOT)
    grpo.main(["--config", str(path), "--output_dir", str(tmp_path)])
    logs = [log for log in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"] if "loss" in log]
    assert logs and any(log["grad_norm"] > 0 for log in logs), logs
    assert any(log.get("frac_reward_zero_std", 1) < 1 for log in logs), logs


FAST_RECIPES = sorted(p for p in PAPER_RECIPES if p.stem.endswith("_fast"))
FAST_FIELDS = {"confidence_threshold", "generation_cache", "block_kv_cache", "eos_early_exit", "output_dir"}


def test_fast_variants_exist_for_the_main_recipe_of_each_family():
    assert {rel(p) for p in FAST_RECIPES} >= {"recipes/llada/stabledrl_gsm8k_lora_fast.yaml",
                                              "recipes/dream/stabledrl_gsm8k_fast.yaml",
                                              "recipes/sdar/stabledrl_gsm8k_fast.yaml",
                                              "recipes/llada2/stabledrl_gsm8k_fast.yaml"}  # fmt: skip


@pytest.mark.parametrize("path", FAST_RECIPES, ids=rel)
def test_fast_variant_differs_from_its_paper_recipe_only_in_decoding(path):
    """A `*_fast.yaml` is its paper recipe with faster rollout decoding: every other field equal (the paper recipe
    stays faithful, the fast one changes nothing of the objective, likelihood or optimiser)."""
    paper = path.with_name(path.name.replace("_fast.yaml", ".yaml"))
    fast, base = yaml.safe_load(path.read_text()), yaml.safe_load(paper.read_text())
    changed = {k for k in fast.keys() | base.keys() if fast.get(k) != base.get(k)}
    assert changed <= FAST_FIELDS and changed - {"output_dir"}, changed
    assert f"Fast variant of {rel(paper)}" in path.read_text()
    _, args, _ = parse(path)  # and it parses (the generation checks of the config pass)
    assert args.confidence_threshold is not None or args.generation_cache != "none"


@pytest.mark.parametrize("path", DPO_RECIPES, ids=rel)
def test_dpo_recipe_parses(path):
    """A `trl-dllm dpo` recipe fills the DPO script's dataclasses; a paper one states its source and launch command."""
    from trl_dllm.scripts.dpo import make_parser as make_dpo_parser

    argv = ["--config", str(path), "--bf16", "false", "--use_cpu", "true"]
    script_args, args, _ = make_dpo_parser().parse(argv)
    assert script_args.dataset_name and args.estimator in (None, "elbo", "mean_field", "coupled", "block")
    if path.parent.name != "tiny":
        text = path.read_text()
        assert "# Source:" in text and "github.com/" in text and f"--config {rel(path)}" in text


def test_vrpo_recipe_holds_the_released_values():
    """LLaDA 1.5's VRPO as DARE's recipe sets it (the recipe's header names each file): budget 4 with one mask per
    timestep, masks shared with the reference, beta 0.2, lr 5e-7, 64 pairs per update on 8 processes."""
    config = yaml.safe_load((ROOT / "recipes" / "llada" / "vrpo_ultrafeedback.yaml").read_text())
    assert (config["mc_samples"], config["mc_masks_per_timestep"], config["independent_mc_noise"]) == (4, 1, False)
    assert (config["beta"], config["learning_rate"], config["weight_decay"], config["loss_type"]) == (
        0.2, 5e-7, 0.01, "sigmoid")  # fmt: skip
    assert 8 * config["per_device_train_batch_size"] * config["gradient_accumulation_steps"] == 64
