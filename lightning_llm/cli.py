"""``lightning-llm``: a LightningCLI with the reference model and data module as defaults.

Any LightningModule / LightningDataModule can replace them with ``class_path`` in the config.
W&B is configured the way W&B itself is (``wandb login``, ``wandb offline``, ``WANDB_MODE``,
``WANDB_API_KEY``); only where none of them is set does the CLI log offline, and says so
(:mod:`lightning_llm.wandb_mode`).

Example::

    lightning-llm fit --config configs/tiny.yaml
    lightning-llm fit --config configs/tiny.yaml --trainer.max_steps 50 --model.init_args.learning_rate 1e-3
    lightning-llm plan --config configs/llama7b.yaml --devices 8 --device_memory 80GB
    lightning-llm prepare corpus/ --output_dir data --vocab_size 32000 --val_fraction 0.01 --workers 8
    lightning-llm export checkpoints/last.ckpt export/hf --format hf --dtype bfloat16
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path

import yaml
from jsonargparse import Namespace, lazy_instance
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import lightning_llm.strategies  # noqa: F401 - registers the llm_* strategy names in Lightning's StrategyRegistry
from lightning_llm.checkpointing.resume_path import check_checkpoint_path
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.validation import check_float, check_int
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
    """Saves the resolved config to the log directory (as LightningCLI does) and into every logger's
    hyperparameters, so a W&B run carries the exact config that produced it."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams({"cli_config": config})


class LLMCLI(LightningCLI):
    """LightningCLI whose model and data default to :class:`CausalLM` and :class:`LLMDataModule`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", ConfigToLoggers)
        kwargs.setdefault("parser_kwargs", {"epilog": _EPILOG})
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


def _offline_unless_configured(trainer) -> None:
    """With a WandbLogger on a machine where W&B was never configured: offline mode, said once, naming the folder."""
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    wandb = [each for each in loggers if str(getattr(each, "class_path", "")).endswith("WandbLogger")]
    if not wandb or not wandb_installed():
        return
    init_args = wandb[0].get("init_args") or {}
    save_dir = init_args.get("save_dir") or init_args.get("dir")  # WandbLogger's default: "."
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


def plan(args: list[str]) -> str:
    """``lightning-llm plan``: the memory table and ZeRO decision for a config, without training or allocating.

    The model is built on the meta device, so 7B and 70B configs plan in seconds on a laptop. The
    strategy's tensor/pipeline sizes and checkpointing mode are read from the config; ``--devices``,
    ``--num_nodes`` and ``--device_memory`` override the machine.
    """
    import argparse

    import torch

    from lightning_llm.planning.zero import MemoryPlanError, parse_size
    from lightning_llm.strategies.zero_auto import choose_zero_stage

    parser = argparse.ArgumentParser(prog="lightning-llm plan", description=plan.__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a lightning-llm / LightningCLI YAML config")
    parser.add_argument("--devices", type=int, help="devices per node (default: the config's trainer.devices)")
    parser.add_argument("--num_nodes", type=int, help="nodes (default: the config's trainer.num_nodes)")
    parser.add_argument("--device_memory", default="80GB", help="memory per device, e.g. 80GB, 141GB, 24GiB")
    parser.add_argument("--backend", choices=("native", "deepspeed"), help="default: from the config's strategy")
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of device memory kept free")
    options = parser.parse_args(args)
    try:
        _check_plan_options(options)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    config = yaml.safe_load(Path(options.config).read_text()) or {}
    trainer_config = config.get("trainer") or {}
    with torch.device("meta"), _quiet():
        cli = LLMCLI(args=_planning_config(config), run=False, save_config_callback=None)
        module = cli.model
        if hasattr(module, "configure_model"):
            module.configure_model()
    from lightning_llm.strategies import LLMParallelStrategy

    strategy = cli.trainer.strategy
    native = isinstance(strategy, LLMParallelStrategy)
    devices = options.devices or trainer_config.get("devices")
    devices = devices if isinstance(devices, int) else 1
    nodes = options.num_nodes or trainer_config.get("num_nodes") or 1
    backend = options.backend or ("deepspeed" if "DeepSpeed" in type(strategy).__name__ else "native")
    hparams = cli.datamodule.hparams
    settings = dict(
        device_memory=parse_size(options.device_memory),
        world_size=devices * nodes,
        tp=strategy.tensor_parallel_size if native else 1,
        pp=strategy.pipeline_parallel_size if native else 1,
        cp=strategy.context_parallel_size if native else 1,
        ep=strategy.expert_parallel_size if native else 1,
        expert_parallel_plan=strategy.expert_parallel_plan if native else None,
        micro_batch_size=hparams.get("batch_size", 1),
        seq_len=hparams.get("seq_len", 2048),
        precision=str(cli.trainer.precision),
        activation_checkpointing=strategy.activation_checkpointing if native else "none",
        ac_options=strategy.ac_options if native else None,
        backend=backend,
        margin=options.margin,
        whole_grads=native
        and cli.trainer.accumulate_grad_batches > 1
        and strategy.accumulation_sync == "last_micro_batch",
    )
    try:
        _check_layout(module, settings["world_size"], settings["tp"], settings["pp"], settings["cp"])
        if native:  # the layout checks fit runs at setup, on the same options
            _check_strategy_layout(strategy, module, settings["world_size"])
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    params = sum(p.numel() for p in module.parameters())
    dp = settings["world_size"] // (settings["tp"] * settings["pp"] * settings["cp"])
    sequences = settings["micro_batch_size"] * dp * cli.trainer.accumulate_grad_batches
    header = (
        f"{type(module).__name__}: {params / 1e9:.2f}B parameters; {settings['world_size']} devices x "
        f"{options.device_memory}; tp={settings['tp']} pp={settings['pp']} cp={settings['cp']}; micro-batch "
        f"{settings['micro_batch_size']} x {settings['seq_len']} tokens; {settings['precision']}; {backend}\n"
        f"global batch: {sequences} sequences, {sequences * settings['seq_len']:,} tokens per optimizer step "
        f"(micro-batch {settings['micro_batch_size']} x dp {dp} x accumulate_grad_batches "
        f"{cli.trainer.accumulate_grad_batches})"
    )
    try:
        decision = choose_zero_stage(module, **settings)
        report = f"{header}\n{decision.table}\nChosen: ZeRO {decision.stage}, offload {decision.offload}"
    except MemoryPlanError as err:
        print(f"{header}\n{err}")
        raise SystemExit(1) from None  # nothing fits: a script or CI job must see the failure
    print(report)
    return report


def _planning_config(config: dict) -> dict:
    """The config ``plan`` parses: the same model, data and strategy, a Trainer for one CPU, no logger or callbacks.

    The planning machine need not be the training one: the devices and nodes come from the config (or the
    flags), the model is built on the meta device. The config's logger and callbacks are left out before
    parsing, not overridden after: resolving ``WandbLogger``'s signature alone imports wandb (0.2 s).
    """
    trainer = {k: v for k, v in (config.get("trainer") or {}).items() if k not in ("logger", "callbacks")}
    # Nothing random is drawn while planning; LightningCLI's default seeding would only warn "No seed found".
    seed = config.get("seed_everything", False)
    return {
        **config,
        "seed_everything": seed,
        "trainer": {**trainer, "logger": False, "accelerator": "cpu", "devices": 1, "num_nodes": 1},
    }


@contextlib.contextmanager
def _quiet():
    """No Trainer banners ("GPU available: ...") and no LightningCLI warning about ``args``: ``plan`` prints its table."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_llm")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _check_plan_options(options) -> None:
    """Flags of ``plan`` that are wrong whatever the model: refused before anything is built."""
    from lightning_llm.planning.zero import parse_size

    for flag, value in (("--devices", options.devices), ("--num_nodes", options.num_nodes)):
        if value is not None:
            check_int(flag, value, minimum=1)
    check_float("--margin", options.margin, minimum=0, hint="the fraction of device memory kept free, in [0, 1)")
    if options.margin >= 1:
        raise ValueError(f"--margin={options.margin!r} must be below 1 (the fraction of device memory kept free).")
    if parse_size(options.device_memory) <= 0:
        raise ValueError(f"--device_memory={options.device_memory!r} must be a positive size such as 80GB.")


def _check_strategy_layout(strategy, module, world_size: int) -> None:
    """What LLMParallelStrategy's setup checks before parallelizing: the mesh's degrees and the pipeline stages."""
    from lightning_llm.modeling.blocks import find_blocks
    from lightning_llm.strategies.parallel_setup import parallel_dims

    parallel_dims(strategy.options, world_size)  # data_parallel_size, replicate groups, ... against the world
    pp = strategy.pipeline_parallel_size
    stages = pp * strategy.options.pipeline.spec().stages_per_rank() if pp > 1 else 1
    blocks = len(find_blocks(module, strategy.blocks)[1])
    if stages > blocks:
        raise ValueError(
            f"{stages} pipeline stages need at least as many transformer blocks, but the model has {blocks}; "
            "lower pipeline_parallel_size or virtual_stages."
        )


def _check_layout(module, world_size: int, tp: int, pp: int, cp: int = 1) -> None:
    """The parallel layout against the machine and the model: tp divides the heads, pp fits the blocks."""
    from lightning_llm.modeling.blocks import find_blocks

    if world_size % (tp * pp * cp):
        context = f" x context_parallel_size={cp}" if cp > 1 else ""
        raise ValueError(
            f"{world_size} devices cannot be split into tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
            f"{context} groups; use a device count that is a multiple of {tp * pp * cp}, or other sizes."
        )
    config = getattr(module, "config", None)
    for name in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {name}={heads}: tensor parallelism splits "
                f"whole heads. Choose a tp that divides {heads}."
            )
    _, blocks = find_blocks(module, None)
    if pp > len(blocks):
        raise ValueError(
            f"pipeline_parallel_size={pp} is more than the model's {len(blocks)} blocks: every stage needs at least "
            f"one. Use pipeline_parallel_size <= {len(blocks)}."
        )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plan"]:
        plan(argv[1:])
        return
    if argv[:1] == ["prepare"]:
        from lightning_llm.data.prepare import command

        command(argv[1:])
        return
    if argv[:1] == ["export"]:
        from lightning_llm import export

        export.main(argv[1:])
        return
    LLMCLI(args=args)


if __name__ == "__main__":
    main()
