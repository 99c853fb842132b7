"""A mistake in a ``lightning-llm`` command is one message naming it and the fix (lightning_llm.cli.errors).

Missing and unreadable configs, an unknown preset, a typo in a strategy option or a Trainer flag, an unknown
subcommand, and an error raised while the run is set up: each prints its message alone (no usage pages, no
traceback unless ``--traceback``), with the closest name where there is one. The same refused layout on 2 ranks,
printed once, is in tests/test_console.py.
"""

from pathlib import Path

import pytest

from lightning_llm.cli import main

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]


def _error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["fit", "plan", "validate"])
def test_a_missing_config_is_one_line_naming_it(capsys, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    code, lines = _error(capsys, [command, "--config", "missing.yaml"])
    assert code == 2 and lines == [
        f"lightning-llm {command}: error: config file missing.yaml does not exist (looked in {tmp_path})."
    ]


def test_an_unreadable_config_is_one_line_naming_it_and_the_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    code, lines = _error(capsys, ["fit", "--config", str(bad)])
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"lightning-llm fit: error: config file {bad} is not valid YAML (line 3)")
    code, lines = _error(capsys, ["plan", "--config", str(tmp_path)])
    assert code == 2 and lines == [
        f"lightning-llm plan: error: config file {tmp_path} is a directory; pass a YAML file, e.g. configs/tiny.yaml."
    ]


def test_an_unknown_preset_lists_the_packages_presets(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, lines = _error(capsys, ["fit", "--config", TINY, "--trainer.strategy", "llm_tp3", *QUIET])
    message = lines[-1]
    assert code == 2 and message.startswith(
        "lightning-llm fit: error: unknown strategy 'llm_tp3'; did you mean 'llm_tp2'?"
    )
    assert "llm_tp2_sp" in message and "llm_deepspeed_zero3" in message and "ddp" in message


def test_a_typo_in_a_strategy_option_suggests_the_closest_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", TINY, "--trainer.strategy", "LLMParallelStrategy"]
    code, lines = _error(capsys, [*argv, "--trainer.strategy.tensor_paralel_size", "2", *QUIET])
    assert code == 2 and lines == [
        "lightning-llm fit: error: LLMParallelStrategy has no option 'tensor_paralel_size'; did you mean "
        "'tensor_parallel_size'?",
        "(`lightning-llm fit --help` lists what it accepts)",
    ]


def test_a_typo_in_a_trainer_flag_and_an_unknown_subcommand_are_named(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, lines = _error(capsys, ["fit", "--config", TINY, "--trainer.max_stepz", "3"])
    assert code == 2 and lines[0] == (
        "lightning-llm fit: error: unknown option --trainer.max_stepz; did you mean '--trainer.max_steps'?"
    )
    code, lines = _error(capsys, ["fitt", "--config", TINY])
    assert code == 2 and "invalid choice: 'fitt'" in lines[0] and len(lines) == 2


def test_an_error_before_the_first_step_is_its_message_and_the_traceback_on_request(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", TINY, "--trainer.strategy", "LLMParallelStrategy"]
    argv += ["--trainer.strategy.tensor_parallel_size", "0", *QUIET]
    code, lines = _error(capsys, argv)
    assert (
        code == 1
        and lines[-2].startswith("lightning-llm fit: error: tensor_parallel_size")
        and lines[-1] == ("(the traceback: add --traceback, or set LIGHTNING_LLM_TRACEBACK=1)")
    )
    monkeypatch.setenv("LIGHTNING_LLM_TRACEBACK", "0")  # restored after the test: --traceback sets it to 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        main([*argv, "--traceback"])
