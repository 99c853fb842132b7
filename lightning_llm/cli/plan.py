"""``lightning-llm plan``: the memory table and ZeRO decision for a config, without training or allocating.

Example::

    lightning-llm plan --config configs/llama7b.yaml --devices 8 --device_memory 80GB
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any

import yaml

from lightning_llm.cli.app import LLMCLI
from lightning_llm.validation import check_float, check_int


def plan(args: list[str]) -> str:
    """``lightning-llm plan``: the memory table and ZeRO decision for a config, without training or allocating.

    The model is built on the meta device, so 7B and 70B configs plan in seconds on a laptop. The
    strategy's tensor/pipeline sizes and checkpointing mode are read from the config; ``--devices``,
    ``--num_nodes`` and ``--device_memory`` override the machine.
    """
    from lightning_llm.planning.zero import MemoryPlanError
    from lightning_llm.strategies.zero_auto import choose_zero_stage

    parser = _parser()
    options = parser.parse_args(args)
    try:
        _check_plan_options(options)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    config = _read_config(parser, options.config)
    cli, module = _build_on_meta(config)
    settings = _settings(options, config.get("trainer") or {}, cli)
    try:
        _check_layout(module, settings["world_size"], settings["tp"], settings["pp"], settings["cp"])
        if _is_native(cli.trainer.strategy):  # the layout checks fit runs at setup, on the same options
            _check_strategy_layout(cli.trainer.strategy, module, settings["world_size"])
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    header = _header(module, settings, options.device_memory, cli.trainer.accumulate_grad_batches)
    if options.layout == "auto":
        from lightning_llm.cli.plan_layout import layout_report

        report = f"{header}\n" + layout_report(
            module,
            settings,
            rates_name=options.rates,
            accumulate=cli.trainer.accumulate_grad_batches,
            devices_per_node=options.devices or (config.get("trainer") or {}).get("devices") or 8,
        )
        print(report)
        return report
    try:
        decision = choose_zero_stage(module, **settings)
        report = f"{header}\n{decision.table}\nChosen: ZeRO {decision.stage}, offload {decision.offload}"
    except MemoryPlanError as err:
        print(f"{header}\n{err}")
        raise SystemExit(1) from None  # nothing fits: a script or CI job must see the failure
    print(report)
    return report


def _parser():
    """The flags of ``lightning-llm plan``."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-llm plan", description=plan.__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a lightning-llm / LightningCLI YAML config")
    parser.add_argument("--devices", type=int, help="devices per node (default: the config's trainer.devices)")
    parser.add_argument("--num_nodes", type=int, help="nodes (default: the config's trainer.num_nodes)")
    parser.add_argument(
        "--device_memory",
        default="80GB",
        help="memory per device: a name (H100, H200, A100-40GB), a size as sold (80GB, 141GB) or exact (79.6GiB)",
    )
    parser.add_argument("--backend", choices=("native", "deepspeed"), help="default: from the config's strategy")
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of device memory kept free")
    parser.add_argument(
        "--layout", choices=("config", "auto"), default="config", help="auto: rank every layout by step time"
    )
    parser.add_argument("--rates", default="H100", help="with --layout auto: H100, H200, A100, or calibrate")
    return parser


def _build_on_meta(config: dict):
    """(the LightningCLI, the model) of ``config``, the model built on the meta device (nothing allocated)."""
    import torch

    with torch.device("meta"), _quiet():
        cli = LLMCLI(args=_planning_config(config), run=False, save_config_callback=None)
        module = cli.model
        if hasattr(module, "configure_model"):
            module.configure_model()
    return cli, module


def _is_native(strategy) -> bool:
    from lightning_llm.strategies import LLMParallelStrategy

    return isinstance(strategy, LLMParallelStrategy)


def _settings(options, trainer_config: dict, cli) -> dict[str, Any]:
    """The keyword arguments of ``choose_zero_stage``: the machine from the flags (else the config), the layout and
    precision from the config's strategy and Trainer, the micro-batch from its data module."""
    from lightning_llm.parallel.data_parallel import holds_whole_gradients
    from lightning_llm.planning.device_memory import device_memory_bytes

    strategy = cli.trainer.strategy
    native = _is_native(strategy)
    devices = options.devices or trainer_config.get("devices")
    devices = devices if isinstance(devices, int) else 1
    nodes = options.num_nodes or trainer_config.get("num_nodes") or 1
    hparams = cli.datamodule.hparams
    return dict(
        device_memory=device_memory_bytes(options.device_memory),
        world_size=devices * nodes,
        tp=strategy.tensor_parallel_size if native else 1,
        pp=strategy.pipeline_parallel_size if native else 1,
        cp=strategy.context_parallel_size if native else 1,
        context_parallel_method=strategy.context_parallel_method if native else "ring",
        ep=strategy.expert_parallel_size if native else 1,
        expert_parallel_plan=strategy.expert_parallel_plan if native else None,
        sequence_parallel=native and strategy.sequence_parallel,
        tensor_parallel_plan=strategy.tensor_parallel_plan if native else None,
        tensor_parallel_replicate=strategy.tensor_parallel_replicate if native else (),
        micro_batch_size=hparams.get("batch_size", 1),
        seq_len=hparams.get("seq_len", 2048),
        documents=bool(hparams.get("return_document_ids", False)),
        precision=str(cli.trainer.precision),
        activation_checkpointing=strategy.activation_checkpointing if native else "none",
        ac_options=strategy.ac_options if native else None,
        backend=options.backend or ("deepspeed" if "DeepSpeed" in type(strategy).__name__ else "native"),
        margin=options.margin,
        # a pipeline runs at least pipeline_parallel_size micro-batches
        whole_grads=native
        and holds_whole_gradients(
            strategy.accumulation_sync, cli.trainer.accumulate_grad_batches, strategy.pipeline_parallel_size
        ),
    )


def _header(module, settings: dict[str, Any], device_memory: str, accumulate_grad_batches: int) -> str:
    """The lines above the table: the model, the machine, the layout, and the global batch they make."""
    params = sum(p.numel() for p in module.parameters())
    dp = settings["world_size"] // (settings["tp"] * settings["pp"] * settings["cp"])
    sequences = settings["micro_batch_size"] * dp * accumulate_grad_batches
    return (
        f"{type(module).__name__}: {params / 1e9:.2f}B parameters; {settings['world_size']} devices x "
        f"{device_memory} ({settings['device_memory'] / 2**30:.1f} GiB); "
        f"tp={settings['tp']} pp={settings['pp']} cp={settings['cp']}; micro-batch "
        f"{settings['micro_batch_size']} x {settings['seq_len']} tokens; {settings['precision']}; "
        f"{settings['backend']}\n"
        f"global batch: {sequences} sequences, {sequences * settings['seq_len']:,} tokens per optimizer step "
        f"(micro-batch {settings['micro_batch_size']} x dp {dp} x accumulate_grad_batches "
        f"{accumulate_grad_batches})"
    )


def _read_config(parser, path: str) -> dict:
    """The YAML config at ``path`` as a dict; a missing, binary or malformed file is refused naming it."""
    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        parser.error(f"--config {path}: {err.strerror or err}; pass a LightningCLI YAML config.")
    except UnicodeDecodeError as err:
        parser.error(
            f"--config {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "pass a LightningCLI YAML config."
        )
    except yaml.YAMLError as err:
        parser.error(f"--config {path} is not valid YAML ({err}); fix it or pass another config.")
    if config is not None and not isinstance(config, dict):
        parser.error(f"--config {path} holds a {type(config).__name__}, not a mapping of trainer/model/data sections.")
    return config or {}


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
    from lightning_llm.planning.device_memory import device_memory_bytes

    for flag, value in (("--devices", options.devices), ("--num_nodes", options.num_nodes)):
        if value is not None:
            check_int(flag, value, minimum=1)
    check_float("--margin", options.margin, minimum=0, hint="the fraction of device memory kept free, in [0, 1)")
    if options.margin >= 1:
        raise ValueError(f"--margin={options.margin!r} must be below 1 (the fraction of device memory kept free).")
    if device_memory_bytes(options.device_memory) <= 0:
        raise ValueError(f"--device_memory={options.device_memory!r} must be a positive size such as 80GB.")


def _check_strategy_layout(strategy, module, world_size: int) -> None:
    """What LLMParallelStrategy's setup checks before parallelizing: the mesh's degrees and the pipeline stages."""
    from lightning_llm.modeling.blocks import find_blocks
    from lightning_llm.strategies.parallel_setup import check_pipeline_stages, parallel_dims

    parallel_dims(strategy.options, world_size)  # data_parallel_size, replicate groups, ... against the world
    check_pipeline_stages(find_blocks(module, strategy.options.parallel.blocks), strategy.options)


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
