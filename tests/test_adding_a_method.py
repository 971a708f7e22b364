"""Adding an estimator with a new option is its module and one registry line: the config gains the field (with its
help, docstring entry and check), the CLI parses it, and the trainer passes its value to the estimator.

The throwaway estimator is registered in a fresh interpreter before `trl_dllm.config` is imported, as its registry
line in `trl_dllm/core/likelihood/__init__.py` would be."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    from datasets import Dataset

    from trl_dllm.core.likelihood import ESTIMATORS, Estimator, mean_field
    from trl_dllm.core.likelihood.mean_field import mean_field_views
    from trl_dllm.core.likelihood._options import MEMORY, P_MASK_PROMPT
    from trl_dllm.core.options import Option, greater_than

    ALPHA = Option(
        "alpha", "tempered_alpha", 1.0, "float", help="tempered: the power of d1's one-step estimate.",
        doc="For {estimators}: the power of d1's one-step estimate.", check=greater_than(0), hint="e.g. 0.5",
    )
    SEEN = []

    def tempered(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, *, mask_token_id, seeds, alpha=1.0,
                 p_mask_prompt=0.0, checkpoint_views=False, entropy_grad=True):
        SEEN.append(alpha)
        out = mean_field(logits_fn, prompt_ids, prompt_mask, completion_ids, score_mask, mask_token_id=mask_token_id,
                         seeds=seeds, p_mask_prompt=p_mask_prompt, checkpoint_views=checkpoint_views,
                         entropy_grad=entropy_grad)
        out.logps = alpha * out.logps
        return out

    ESTIMATORS["tempered"] = Estimator(tempered, "a tempered one-step estimate", mean_field_views,
                                       options=(ALPHA, P_MASK_PROMPT, *MEMORY),
                                       objectives=("stabledrl",))

    from trl import TrlParser

    from trl_dllm import DiffusionGRPOConfig, DiffusionGRPOTrainer

    model_path, output_dir = sys.argv[1:]
    common = dict(output_dir=output_dir, per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                  block_length=4, diffusion_steps=4, max_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    assert "tempered_alpha (`float`, *optional*, defaults to `1.0`)" in DiffusionGRPOConfig.__doc__
    assert '`"tempered"` (a tempered one-step estimate)' in DiffusionGRPOConfig.__doc__
    try:
        DiffusionGRPOConfig(**common, estimator="tempered", tempered_alpha=0.0)
    except ValueError as error:
        assert str(error) == "tempered_alpha=0.0 must be > 0 (e.g. 0.5).", error
    else:
        raise AssertionError("tempered_alpha=0.0 was accepted")
    (parsed,) = TrlParser(DiffusionGRPOConfig).parse_args_into_dataclasses(
        [f"--{key}={value}" for key, value in common.items()] + ["--estimator=tempered", "--tempered_alpha=0.25",
                                                                  "--loss_type=stabledrl"]
    )
    assert parsed.tempered_alpha == 0.25
    dataset = Dataset.from_dict({"prompt": ["add 1 and 2 .", "add 2 and 3 ."]})
    trainer = DiffusionGRPOTrainer(model=model_path, reward_funcs=lambda completions, **kw: [float(len(c)) for c in
                                   completions], args=parsed, train_dataset=dataset)
    trainer.train()
    assert SEEN and set(SEEN) == {0.25}, SEEN
    print("ok")
    """
)


def test_a_new_estimator_with_a_new_option_is_one_registry_line(tmp_path, tiny_model_path):
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_path), str(tmp_path / "out")], cwd=root, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
