"""DeepSpeed, torchao, wandb and torchft are optional (extras): the package imports and works without them, and the
features that need them are refused naming the extra to install (issue 32).

Each case runs in a fresh interpreter where those modules cannot be imported (a ``sys.meta_path`` finder
refuses them, as on a cluster image that lacks them), so it runs wherever the suite does, with or without
the extras installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

_BLOCK = """
import sys

BLOCKED = {blocked!r}


class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Missing())
"""


def _run(code: str, blocked: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess:
    script = _BLOCK.format(blocked=set(blocked)) + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=cwd, env=_env()
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_package_imports_and_refuses_each_feature_without_deepspeed_torchao_wandb_torchft(tmp_path):
    code = f"""
    import pytest

    import lightning_llm, lightning_llm.cli, lightning_llm.strategies, lightning_llm.callbacks
    import lightning_llm.models, lightning_llm.data
    from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy

    assert not [name for name in BLOCKED if name in sys.modules]

    with pytest.raises(ImportError, match=r"LLMDeepSpeedStrategy needs DeepSpeed.*pip install 'lightning_llm\\[deepspeed\\]'"):
        LLMDeepSpeedStrategy()
    with pytest.raises(ImportError, match=r"pip install 'lightning_llm\\[deepspeed\\]'"):
        LLMDeepSpeedStrategy(zero_stage=3, offload="optimizer")
    with pytest.raises(RuntimeError, match=r"fp8 training .*torchao.*pip install 'lightning_llm\\[fp8\\]'"):
        LLMParallelStrategy(fp8=True)
    with pytest.raises(RuntimeError, match=r"pip install 'lightning_llm\\[fp8\\]'"):
        LLMParallelStrategy(zero_stage=3, fp8="rowwise")
    with pytest.raises(ImportError, match=r"fault_tolerance needs torchft: pip install 'lightning_llm\\[ft\\]'"):
        LLMParallelStrategy(fault_tolerance=True)
    LLMParallelStrategy(zero_stage=3)  # what needs none of them still works
    LLMParallelStrategy(fp8=False)

    from lightning.pytorch.loggers import CSVLogger
    from lightning_llm.cli import LLMCLI, main

    # A config naming a WandbLogger: a parser error naming the extra, before anything is built.
    with pytest.raises(SystemExit):
        LLMCLI(args=["--config", {str(TINY)!r}], run=False)
    # The default logger without wandb: a CSVLogger, and a training run through the console entry point.
    assert isinstance(LLMCLI(args=[], run=False).trainer.logger, CSVLogger)
    main(["fit", "--config", {str(TINY)!r}, "--trainer.logger", "CSVLogger", "--trainer.max_steps", "2",
          "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar",
          "false", "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2"])
    main(["fit", "--trainer.max_steps", "2", "--trainer.accelerator", "cpu", "--trainer.limit_val_batches", "0",
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false", "--model.init_args.config", "tiny",
          "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2"])
    assert not [name for name in BLOCKED if name in sys.modules]
    print("OK")
    """
    result = _run(code, ("deepspeed", "torchao", "wandb", "torchft"), tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "OK"
    assert "error: The config's logger is a WandbLogger, but wandb is not installed" in result.stderr
    assert "pip install 'lightning_llm[wandb]'" in result.stderr
    assert "wandb is not installed: logging to CSV files under ./lightning_logs instead" in result.stderr
    assert "W&B is not configured here" not in result.stderr, "no W&B offline note where W&B is not installed"
    assert list((tmp_path / "runs").glob("*/version_*/metrics.csv")), "under the config's save_dir"
    assert list((tmp_path / "lightning_logs").glob("version_*/metrics.csv")), "the default CSV logger"


def test_library_use_needs_no_jsonargparse(tmp_path):
    """jsonargparse is for the CLI only: strategies, callbacks, models and data import without it."""
    code = """
    import lightning_llm, lightning_llm.strategies, lightning_llm.callbacks, lightning_llm.models, lightning_llm.data
    from lightning_llm.strategies import LLMParallelStrategy

    LLMParallelStrategy(zero_stage=3)
    assert "jsonargparse" not in sys.modules
    print("OK")
    """
    result = _run(code, ("deepspeed", "torchao", "wandb", "jsonargparse"), tmp_path)
    assert result.stdout.strip().splitlines()[-1] == "OK"
