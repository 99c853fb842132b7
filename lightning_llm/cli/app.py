"""The LightningCLI of ``lightning-llm`` (``fit``/``validate``/``test``): defaults, loggers, W&B mode and run names.

Example::

    lightning-llm fit --config configs/tiny.yaml --trainer.max_steps 50 --model.init_args.learning_rate 1e-3
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import yaml
from jsonargparse import Namespace, lazy_instance
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import lightning_llm.strategies  # noqa: F401 - registers the llm_* strategy names in Lightning's StrategyRegistry
from lightning_llm._compat import lightning as compat
from lightning_llm.callbacks import ResumeChecks
from lightning_llm.callbacks.console import upgrade_console
from lightning_llm.checkpointing.resume_path import check_checkpoint_path
from lightning_llm.cli.data_vocab import adopt_data_vocabulary
from lightning_llm.cli.errors import PROG, CommandError, ConciseParser, FirstBatch, unknown_strategy
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.wandb_mode import default_to_offline

_EPILOG = (
    "More subcommands: `lightning-llm plan --config CONFIG [--devices N --device_memory 80GB]` prints the "
    "memory plan and ZeRO decision for a config without training or allocating (see `lightning-llm plan --help`). "
    "`lightning-llm prepare FILES --output_dir data [--tokenizer tokenizer.json | --vocab_size N]` tokenizes "
    ".txt/.jsonl files into the token files `--data.source tokens` reads (see `lightning-llm prepare --help`). "
    "`lightning-llm export CKPT OUT --format hf|torch [--dtype bfloat16]` writes a trained checkpoint of any "
    "layout as a Hugging Face directory or one torch file (see `lightning-llm export --help`)."
)
_DEFAULT_CLASSES = {"model": CausalLM, "data": LLMDataModule}
_DEFAULTS = {key: lazy_instance(cls) for key, cls in _DEFAULT_CLASSES.items()}
# W&B by default (its mode resolved as W&B resolves it: see lightning_llm.wandb_mode), and the LR in it.
# wandb is optional (the `wandb` extra): without it the default is a CSVLogger, said on stderr.
_DEFAULT_LOGGER = "lightning.pytorch.loggers.WandbLogger"
_FALLBACK_LOGGER = "lightning.pytorch.loggers.CSVLogger"
WANDB_INSTALL_HINT = "pip install 'lightning_llm[wandb]'"
_DEFAULT_CALLBACKS = [
    ("lightning.pytorch.callbacks.LearningRateMonitor", {"logging_interval": "step"}),
    ("lightning_llm.callbacks.MemoryMonitor", {}),
    ("lightning_llm.callbacks.RunInfoLogger", {}),
]


class ConfigToLoggers(SaveConfigCallback):
    """Saves the resolved config into this run's own directory (see :func:`run_directory`) and into every logger's
    hyperparameters, so a W&B run carries the exact config that produced it."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Write ``config.yaml`` into this run's own directory: LightningCLI writes it to ``trainer.log_dir``, which
        for a WandbLogger is its ``save_dir``, shared by every run (each replaced the last one's config)."""
        if self.already_saved:
            return
        log_dir = trainer.log_dir if self.save_to_log_dir else None  # a broadcast: every rank asks
        if self.save_to_log_dir and trainer.is_global_zero:
            directory = run_directory(trainer, log_dir)
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = os.path.join(directory, self.config_filename)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams({"cli_config": config})


def run_directory(trainer, log_dir: str | None) -> str:
    """Where this run's files go: a W&B run's own directory (``runs/wandb/offline-run-.../``), else the Trainer's
    ``log_dir`` (CSV and TensorBoard loggers version it: ``lightning_logs/version_3``). Rank 0 only (W&B's run)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        files = getattr(logger.experiment, "dir", None) if isinstance(logger, WandbLogger) else None
        if files:
            return str(Path(files).parent)  # W&B keeps its own config.yaml in files/
    return str(log_dir or ".")


class LLMCLI(LightningCLI):
    """LightningCLI whose model and data default to :class:`CausalLM` and :class:`LLMDataModule`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", ConfigToLoggers)
        kwargs.setdefault("parser_kwargs", {"epilog": _EPILOG, "prog": PROG})
        kwargs.setdefault("parser_class", ConciseParser)  # errors without the 45-line usage, typos with a suggestion
        super().__init__(None, None, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults(_DEFAULTS)
        self._parsers_with_defaults = [*getattr(self, "_parsers_with_defaults", []), parser]

    def parse_arguments(self, parser, args) -> None:
        """Parse; if the user named their own model or data class, parse again without our default for it.

        jsonargparse carries a default instance's init_args over to the class the user names, so with
        ``--model my.Module`` arguments sharing a name with CausalLM's (``learning_rate``, ...) would
        silently take CausalLM's defaults instead of ``my.Module``'s own.
        """
        super().parse_arguments(parser, args)
        config = (
            self.config.get(self.config.get("subcommand"), self.config) if "subcommand" in self.config else self.config
        )
        replaced = {
            key: None
            for key, cls in _DEFAULT_CLASSES.items()
            if config.get(key) is not None and _import(config[key].class_path) is not cls
        }
        if replaced:
            for each in self._parsers_with_defaults:
                each.set_defaults(replaced)
            super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        """Defaults for what the config leaves unset: a W&B logger named after the config
        (``llama7b-tp1-pp1-zeroauto``), and the LR, memory and layout callbacks.

        Set here rather than as ``trainer_defaults``: jsonargparse would carry a default logger's init_args
        (``name``, ``save_dir``, ...) over to another logger class the config names.
        """
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is None:
            return
        _refuse_unknown_strategy(trainer.get("strategy"))
        if trainer.get("logger") is None:
            trainer.logger = _default_logger(trainer)
        _refuse_wandb_logger_without_wandb(self.parser, trainer.get("logger"))
        if not trainer.get("callbacks"):
            trainer.callbacks = [
                Namespace(class_path=path, init_args=Namespace(**args)) for path, args in _DEFAULT_CALLBACKS
            ]
        logger = trainer.get("logger")
        if getattr(logger, "class_path", "").endswith("WandbLogger") and not logger.init_args.get("name"):
            logger.init_args.name = run_name(config)
        _offline_unless_configured(trainer)

    def before_fit(self) -> None:
        # Lightning would open a directory given as ckpt_path as a file (IsADirectoryError) or fail in DCP.
        check_checkpoint_path(self.config_init[self.subcommand].get("ckpt_path"), self.trainer.strategy)
        # Under Lightning's own strategies, a resume's silent outcomes (untied weights into a tied model, a new
        # learning rate replaced by the checkpoint's) are refused or said by this callback; ours check themselves.
        if not any(isinstance(c, ResumeChecks) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(ResumeChecks())
        self._before_run()

    def before_validate(self) -> None:
        self._before_run()

    def before_test(self) -> None:
        self._before_run()

    def before_predict(self) -> None:
        self._quiet_console()

    def _before_run(self) -> None:
        self._quiet_console()
        self._vocabulary_from_data()

    def _quiet_console(self) -> None:
        """The console a newcomer reads (README, "What the console prints"): the step budget in the progress bar,
        the package's FLOPs in the summary, no W&B warning Lightning's logger causes, one message for an early
        error (:class:`~lightning_llm.cli.errors.FirstBatch`)."""
        upgrade_console(self.trainer.callbacks)
        for logger in self.trainer.loggers:
            compat.drop_unset_wandb_anonymous(logger)
        self.trainer.callbacks.append(FirstBatch())

    def _vocabulary_from_data(self) -> None:
        init_args = self.config[self.subcommand].get("model", Namespace()).get("init_args") or Namespace()
        adopt_data_vocabulary(self.model, self.datamodule, init_args.get("config"))


def _refuse_unknown_strategy(strategy) -> None:
    """A strategy name nobody registered: the package's presets and the closest name, not Lightning's examples."""
    if not isinstance(strategy, str):
        return
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_llm.strategies.presets import DEEPSPEED_PRESETS, PARALLEL_PRESETS

    presets = [name for name, _, _ in [*PARALLEL_PRESETS, *DEEPSPEED_PRESETS]]
    refusal = unknown_strategy(strategy, StrategyRegistry.available_strategies(), presets)
    if refusal is not None:
        raise CommandError(refusal)


def _offline_unless_configured(trainer) -> None:
    """With a WandbLogger on a machine where W&B was never configured: offline mode, said once, naming the folder."""
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    wandb = [each for each in loggers if str(getattr(each, "class_path", "")).endswith("WandbLogger")]
    if not wandb or not wandb_installed():
        return
    init_args = wandb[0].get("init_args") or {}
    save_dir = init_args.get("save_dir") or init_args.get("dir")  # WandbLogger's default: "."
    if save_dir:  # W&B looks for a git repository from it before it creates it ("git root runs does not exist")
        Path(str(save_dir)).mkdir(parents=True, exist_ok=True)
    message = default_to_offline(save_dir)
    if message and int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr)


def wandb_installed() -> bool:
    """Whether ``wandb`` can be found (without importing it: that takes 0.2 s and starts nothing useful here)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        return False


def _default_logger(trainer) -> Namespace:
    """A WandbLogger when wandb is installed; else a CSVLogger under the Trainer's root directory, and a note why."""
    if wandb_installed():
        return Namespace(class_path=_DEFAULT_LOGGER, init_args=Namespace(project="lightning-llm"))
    save_dir = str(trainer.get("default_root_dir") or ".")
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"wandb is not installed: logging to CSV files under {save_dir}/lightning_logs instead. "
            f"For W&B: {WANDB_INSTALL_HINT}",
            file=sys.stderr,
        )
    return Namespace(class_path=_FALLBACK_LOGGER, init_args=Namespace(save_dir=save_dir))


def _refuse_wandb_logger_without_wandb(parser, logger) -> None:
    """A config naming a WandbLogger, on a machine without wandb: a parser error naming the extra to install."""
    loggers = logger if isinstance(logger, list) else [logger]
    if not any(str(getattr(each, "class_path", "")).endswith("WandbLogger") for each in loggers):
        return
    if not wandb_installed():
        parser.error(
            "The config's logger is a WandbLogger, but wandb is not installed. Install it "
            f"({WANDB_INSTALL_HINT}) or choose another logger (--trainer.logger CSVLogger, or false for none)."
        )


def run_name(config) -> str:
    """A run name from the config files' names and the strategy's layout, e.g. ``llama7b-tp2-pp1-zero3``."""
    files = [Path(str(p)).stem for p in (config.get("config") or [])]
    strategy = config.get("trainer", {}).get("strategy")
    parts = files or [Path(str(getattr(config.get("model"), "class_path", "model"))).suffix.lstrip(".") or "model"]
    if isinstance(strategy, str):
        parts.append(strategy)
    elif getattr(strategy, "init_args", None) is not None:
        args = strategy.init_args
        if "tensor_parallel_size" in args:
            parts += [f"tp{args.get('tensor_parallel_size')}", f"pp{args.get('pipeline_parallel_size')}"]
        if args.get("zero_stage") is not None:
            parts.append(f"zero{args.get('zero_stage')}")
    return "-".join(str(p) for p in parts)


def _import(class_path: str):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name, None)
