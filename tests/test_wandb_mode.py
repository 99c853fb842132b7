"""The CLI never overrides a W&B configuration; with none at all it logs offline and says so."""

import os
import subprocess
import sys

import pytest

from lightning_llm.wandb_mode import default_to_offline, wandb_configuration
from tests._optional import requires_wandb


@pytest.fixture
def bare(tmp_path, monkeypatch):
    """A machine where W&B was never configured: empty home, no W&B variables, cwd in a fresh directory."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone after the test
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    return home


def test_unconfigured_machine_logs_offline_and_says_how_to_change_it(bare, monkeypatch):
    assert wandb_configuration() is None
    message = default_to_offline()
    assert message is not None and "wandb login" in message
    assert os.environ["WANDB_MODE"] == "offline"


@pytest.mark.parametrize(
    "variable", [("WANDB_MODE", "online"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "x" * 40)]
)
def test_environment_is_respected(bare, monkeypatch, variable):
    monkeypatch.setenv(*variable)
    assert default_to_offline() is None
    assert os.environ.get("WANDB_MODE") == (variable[1] if variable[0] == "WANDB_MODE" else None)


def test_wandb_login_netrc_is_respected(bare, monkeypatch):
    # What `wandb login` writes: a netrc entry for the W&B API host.
    netrc = bare / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert "api.wandb.ai" in wandb_configuration()
    assert default_to_offline() is None


@requires_wandb
def test_wandb_offline_command_is_respected(bare, tmp_path):
    # W&B's own CLI writes its settings file; reading it back is what W&B does too.
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "offline"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(bare)},
    )
    assert result.returncode == 0, result.stderr
    assert wandb_configuration() == "W&B settings (mode = offline)"
    assert default_to_offline() is None


def test_the_notice_names_the_folder_the_run_goes_to(bare):
    message = default_to_offline("runs")
    assert "logging offline to runs/wandb" in message and "wandb sync runs/wandb/offline-run-*" in message


def _cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return subprocess.run(
        [sys.executable, "-m", "lightning_llm.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "HOME": str(cwd)},
    )


@requires_wandb
def test_the_notice_is_said_only_for_runs_that_log_to_wandb(bare, tmp_path):
    notice = "W&B is not configured here"
    assert notice not in _cli(["fit", "--help"], tmp_path).stderr
    fit = ["fit", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.enable_checkpointing", "false"]
    fit += ["--data.num_tokens", "4000", "--data.seq_len", "16", "--model.init_args.config", "tiny"]
    csv = _cli(
        [*fit, "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "csv"], tmp_path
    )
    assert csv.returncode == 0, csv.stderr[-2000:]
    assert notice not in csv.stderr
    wandb = ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger", "--trainer.logger.save_dir", "runs"]
    offline = _cli([*fit, *wandb], tmp_path)
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert f"{notice}" in offline.stderr and "logging offline to runs/wandb" in offline.stderr
    assert list((tmp_path / "runs" / "wandb").glob("offline-run-*"))  # where the notice says
