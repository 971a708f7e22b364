"""What the console shows: DeepSpeed's CPU notice filtered unless DeepSpeed is used, the one-time build announced,
the start-up lines (machine choices, forwards per rollout), TRL's deprecated-name warnings silenced."""

import logging
import warnings

import pytest

from trl_dllm.config import DiffusionGRPOConfig
from trl_dllm.console import (
    announce_deepspeed_cpu_build,
    deepspeed_cpu_build_pending,
    install_log_filters,
    once_per_run,
    quiet_trl_internals,
    startup_lines,
    unsaid,
)


def make(**kwargs):
    base = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=4, report_to="none")
    return DiffusionGRPOConfig(**{**base, **kwargs})


def test_deepspeed_cpu_notice_dropped(monkeypatch):
    install_log_filters()
    install_log_filters()  # idempotent
    filters = [f for f in logging.getLogger("DeepSpeed").filters if type(f).__name__ == "_DeepSpeedCpuNotice"]
    assert len(filters) == 1

    def passes(message: str) -> bool:
        return filters[0].filter(logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, message, None, None))

    notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert not passes(notice) and passes("something else")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # DeepSpeed picks the CPU only where torch sees no GPU
    assert not passes(notice)


def test_torch_distributed_deprecations_of_deepspeed_collectives_silenced():
    install_log_filters()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        install_log_filters()  # its filter goes before the "default" one
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use ...", FutureWarning, stacklevel=1)
    assert [str(w.message)[:30] for w in seen] == ["`torch.distributed.broadcast` "]


def test_deepspeed_build_announced_only_when_pending(monkeypatch, tmp_path, capsys):
    pytest.importorskip("torch.utils.cpp_extension")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert not deepspeed_cpu_build_pending()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert deepspeed_cpu_build_pending()
    announce_deepspeed_cpu_build()
    assert "compiles its communication op" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_RANK", "1")  # one line per machine
    announce_deepspeed_cpu_build()
    assert capsys.readouterr().err == ""
    (tmp_path / "deepspeed_shm_comm").mkdir(exist_ok=True)  # torch creates it when asked where it is
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert not deepspeed_cpu_build_pending()


def test_startup_lines_say_the_cost_of_a_rollout():
    args = make(max_completion_length=512)
    lines = startup_lines(args)
    assert "each rollout batch takes 256 denoising forwards" in lines[-1] and "block_length=32" in lines[-1]
    guided = startup_lines(make(max_completion_length=16, cfg_scale=1.0, confidence_threshold=0.9), block_length=4)
    assert "at most 16 denoising forwards (x2 for cfg_scale)" in guided[-1] and "block_length=4" in guided[-1]
    own = startup_lines(make(max_completion_length=32, eos_early_exit=False), block_length=32, adaptive=True)[-1]
    assert "at most 16 denoising forwards" in own and "Fewer steps make" in own and "confidence_threshold" not in own
    if args._device_choices:  # no bf16 GPU here: the choice is said
        assert lines[0].startswith("trl_dllm: no bf16-capable GPU") and "bf16=False" in lines[0]


def test_trl_deprecated_names_silenced_only_inside():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_trl_internals():
            for name in ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable"):
                warnings.warn(f"`{name}` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
                      stacklevel=1)
    assert len(seen) == 1


def test_startup_lines_said_once_per_run():
    lines = ["trl_dllm: a", "trl_dllm: b"]
    assert unsaid(lines) == lines and unsaid(lines) == lines  # outside a run: every trainer says them
    with once_per_run():
        assert unsaid(lines) == lines
        with once_per_run():  # nested: the outer run's memory
            assert unsaid([*lines, "trl_dllm: c"]) == ["trl_dllm: c"]
        assert unsaid(lines) == []
    assert unsaid(lines) == lines


def test_startup_lines_name_the_estimator_picked_before_the_rollout_cost():
    line = "trl_dllm: estimator='block' (the block_causal kind's own ...)"
    lines = startup_lines(make(max_completion_length=16), block_length=4, estimator_line=line)
    assert line in lines and lines.index(line) == len(lines) - 2 and "denoising forwards" in lines[-1]


def test_importing_the_package_installs_nothing_until_a_name_is_used():
    """`import trl_dllm` leaves the process's logging and warnings as they were; the first name used (which imports
    TRL, transformers and DeepSpeed) installs the filters first."""
    import subprocess
    import sys

    code = (
        "import logging, warnings\n"
        "before = list(warnings.filters)\n"
        "import trl_dllm\n"
        "assert not logging.getLogger('DeepSpeed').filters and warnings.filters == before\n"
        "trl_dllm.MODEL_SPECS\n"
        "assert [type(f).__name__ for f in logging.getLogger('DeepSpeed').filters] == ['_DeepSpeedCpuNotice']\n"
        "assert 'importlib' not in dir(trl_dllm) and 'install_log_filters' not in dir(trl_dllm)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
