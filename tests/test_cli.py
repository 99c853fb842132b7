import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_llm.cli import LLMCLI, main
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from tests._optional import DEEPSPEED_REASON, HAS_DEEPSPEED, requires_wandb

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"


def test_there_are_configs():
    assert any(p.name == "tiny.yaml" for p in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(config, tmp_path, monkeypatch):
    if not HAS_DEEPSPEED and "LLMDeepSpeedStrategy" in config.read_text():
        pytest.skip(DEEPSPEED_REASON)
    monkeypatch.chdir(tmp_path)
    # GPU configs are instantiated on this CPU machine: only the accelerator is overridden.
    cli = LLMCLI(args=["--config", str(config), "--trainer.logger", "false", "--trainer.accelerator", "cpu"], run=False)
    assert cli.trainer is not None
    assert isinstance(cli.model, __import__("lightning").LightningModule)
    assert isinstance(cli.datamodule, __import__("lightning").LightningDataModule)


def test_defaults_are_the_reference_model_and_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = LLMCLI(args=["--trainer.logger", "false"], run=False)
    assert isinstance(cli.model, CausalLM) and isinstance(cli.datamodule, LLMDataModule)


def test_wrong_key_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        LLMCLI(args=["--config", str(TINY), "--model.init_args.learnin_rate", "1"], run=False)
    assert "learnin_rate" in capsys.readouterr().err


def test_wrong_type_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(Path(TINY).read_text())
    config["data"]["init_args"]["batch_size"] = "eight"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        LLMCLI(args=["--config", str(bad)], run=False)
    err = capsys.readouterr().err
    assert "batch_size" in err and "eight" in err


@requires_wandb
def test_fit_through_console_entry_point_logs_to_wandb_offline(tmp_path):
    # A fresh process (W&B writes a second run of one process lazily, if at all), on a machine with no W&B setup.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_llm.cli",
            "fit",
            "--config",
            str(TINY),
            "--trainer.max_steps",
            "30",
            "--trainer.val_check_interval",
            "30",
            "--trainer.limit_val_batches",
            "2",
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=tmp_path,
        env={**env, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "W&B is not configured here" in result.stderr
    # An offline run directory proves the mode; tests/callbacks/test_logging.py reads a run's contents back.
    runs = list((tmp_path / "runs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "the run must be written offline when no W&B key or mode is set"
    # What the CLI adds by default reaches the run: the resolved config, the layout, the LR and memory.
    written = b"".join(f.read_bytes() for f in runs[0].glob("*.wandb"))
    for key in ("cli_config", "parallel/world_size", "lr-AdamW", "memory/rss_gib"):
        assert key.encode() in written, key


@pytest.mark.parametrize("form", ["command line", "yaml"])
def test_user_classes_keep_their_own_defaults(form, tmp_path, monkeypatch):
    # CausalLM's learning_rate=3e-4 / warmup_steps=100 and LLMDataModule's seq_len=128 / batch_size=8 share the
    # names; the user's classes must get their own defaults, and an explicit value still wins.
    monkeypatch.chdir(tmp_path)
    if form == "yaml":
        config = tmp_path / "user.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": {"class_path": "tests._cli_user_classes.UserModule", "init_args": {"warmup_steps": 9}},
                    "data": {"class_path": "tests._cli_user_classes.UserData"},
                }
            )
        )
        args = ["--config", str(config)]
    else:
        args = [
            "--model",
            "tests._cli_user_classes.UserModule",
            "--data",
            "tests._cli_user_classes.UserData",
            "--model.warmup_steps",
            "9",
        ]
    cli = LLMCLI(args=[*args, "--trainer.logger", "false"], run=False)
    assert type(cli.model).__name__ == "UserModule" and type(cli.datamodule).__name__ == "UserData"
    assert (cli.model.hparams.learning_rate, cli.model.hparams.warmup_steps) == (1e-3, 9)
    assert (cli.datamodule.hparams.seq_len, cli.datamodule.hparams.batch_size) == (32, 3)


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan,prepare,export}" in out.splitlines()[0]
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed[:7] == ["fit", "validate", "test", "predict", "plan", "prepare", "export"]


@pytest.mark.parametrize("config", ["tiny.yaml", "llama7b.yaml"])  # llama7b has no seed_everything
def test_plan_prints_its_table_and_nothing_else(config):
    # A fresh process, so Lightning's log handlers write to the captured stderr.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_llm.cli",
            "plan",
            "--config",
            f"configs/{config}",
            "--devices",
            "8",
            "--device_memory",
            "80GB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(TINY).parents[1],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Chosen: ZeRO" in result.stdout
    for noise in ("GPU available", "TPU available", "LightningCLI's args", "Tip:", "No seed found"):
        assert noise not in result.stdout + result.stderr, noise


def test_plan_imports_neither_wandb_nor_deepspeed():
    # The 7B config names a WandbLogger and the DeepSpeed strategy is registered: plan needs neither module.
    code = (
        "import sys; from lightning_llm.cli import plan; plan(['--config', 'configs/llama7b.yaml']); "
        "print(sorted(m for m in ('wandb', 'deepspeed') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _fit_on_prepared_tokens(tmp_path, *extra):
    from lightning_llm.data.prepare import prepare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over {i} lazy dogs" for i in range(40)))
    prepare([corpus], tmp_path / "data", vocab_size=300, txt_split="blank_line", workers=1)
    args = ["fit", "--config", str(TINY), "--data.source", "tokens", "--data.path", str(tmp_path / "data/train.bin")]
    args += ["--data.batch_size", "2", "--data.seq_len", "16", "--trainer.max_steps", "1", "--trainer.logger"]
    args += ["CSVLogger", "--trainer.logger.save_dir", str(tmp_path), "--trainer.limit_val_batches", "0"]
    args += ["--trainer.val_check_interval", "1", *extra]  # the Lightning floor checks it against the 17 batches
    return LLMCLI(args=args)


def test_fit_sizes_a_preset_model_to_the_vocabulary_prepare_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli = _fit_on_prepared_tokens(tmp_path, "--trainer.enable_checkpointing", "true")
    assert cli.model.model.tok_embeddings.num_embeddings == 300  # the preset 'tiny' has 256
    assert "model vocab_size 256 -> 300, from" in capsys.readouterr().err
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    assert CausalLM.load_from_checkpoint(checkpoint, weights_only=False).config.vocab_size == 300


def test_a_vocabulary_the_user_wrote_is_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli = _fit_on_prepared_tokens(tmp_path, "--model.init_args.config", '{"vocab_size": 320, "dim": 32}')
    assert cli.model.model.tok_embeddings.num_embeddings == 320
    assert "model vocab_size" not in capsys.readouterr().err
