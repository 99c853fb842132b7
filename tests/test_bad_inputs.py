"""Bad input, table-driven: every case must fail with an error that names the bad value, before any training step.

Three kinds of case, cheapest first and none spawning a process:
* constructors (strategies, callbacks, data, model config): the error comes from ``__init__``;
* fit-time cases that need the model and the data together: a callback counts training steps and must count 0;
* the ``lightning-llm`` CLI (``plan`` and ``fit``), in process: exit code non-zero and the value in the message.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml

from lightning_llm.callbacks import (
    CheckpointRotation,
    GradNormMonitor,
    LossSpikeGuard,
    MFUMonitor,
    RankWatchdog,
)
from lightning_llm.cli import LLMCLI, main
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer

NAN, INF = float("nan"), float("inf")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# (factory, keyword arguments, the text naming the bad value)
CONSTRUCTOR_CASES = [
    (LLMParallelStrategy, {"pipeline_parallel_size": "2"}, "pipeline_parallel_size='2'"),
    (LLMParallelStrategy, {"pipeline_parallel_size": 0}, "pipeline_parallel_size=0"),
    (LLMParallelStrategy, {"pipeline_parallel_size": -1}, "pipeline_parallel_size=-1"),
    (LLMParallelStrategy, {"pipeline_parallel_size": 2.0}, "pipeline_parallel_size=2.0"),
    (LLMParallelStrategy, {"tensor_parallel_size": "2"}, "tensor_parallel_size='2'"),
    (LLMParallelStrategy, {"tensor_parallel_size": 0}, "tensor_parallel_size=0"),
    (LLMParallelStrategy, {"tensor_parallel_size": True}, "tensor_parallel_size=True"),
    (LLMParallelStrategy, {"data_parallel_size": "4"}, "data_parallel_size='4'"),
    (LLMParallelStrategy, {"data_parallel_size": 0}, "data_parallel_size=0"),
    (LLMParallelStrategy, {"data_parallel_replicate_size": 1.5}, "data_parallel_replicate_size=1.5"),
    (LLMParallelStrategy, {"zero_stage": "3"}, "zero_stage='3'"),
    (LLMParallelStrategy, {"zero_stage": 4}, "zero_stage=4"),
    (LLMParallelStrategy, {"zero_stage": True}, "zero_stage=True"),
    (LLMParallelStrategy, {"layout": "fastest"}, "layout='fastest'"),
    (LLMParallelStrategy, {"layout": True}, "layout=True"),
    (LLMParallelStrategy, {"layout": "auto", "layout_rates": "B300"}, "layout_rates='B300'"),
    (
        LLMParallelStrategy,
        {"layout": "auto", "pipeline_parallel_size": 2},
        "layout='auto' chooses the layout, but pipeline_parallel_size=2 was given",
    ),
    (LLMParallelStrategy, {"layout": "auto", "zero_stage": 0}, "layout='auto' chooses the layout, but zero_stage=0"),
    (
        LLMParallelStrategy,
        {"layout": "auto", "activation_checkpointing": "full"},
        "layout='auto' chooses the layout, but activation_checkpointing='full'",
    ),
    (LLMParallelStrategy, {"sequence_parallel": "yes", "tensor_parallel_size": 2}, "sequence_parallel='yes'"),
    (LLMParallelStrategy, {"num_microbatches": 0, "pipeline_parallel_size": 2}, "num_microbatches=0"),
    (LLMParallelStrategy, {"num_microbatches": "4", "pipeline_parallel_size": 2}, "num_microbatches='4'"),
    (LLMParallelStrategy, {"virtual_stages": 0, "pipeline_parallel_size": 2}, "virtual_stages=0"),
    (LLMParallelStrategy, {"device_memory": -5, "zero_stage": "auto"}, "device_memory=-5"),
    (LLMParallelStrategy, {"device_memory": "-80GB", "zero_stage": "auto"}, "device_memory='-80GB'"),
    (LLMParallelStrategy, {"device_memory": "eighty", "zero_stage": "auto"}, "'eighty'"),
    (LLMParallelStrategy, {"timeout": -1}, "timeout=-1"),
    (LLMParallelStrategy, {"timeout": timedelta(seconds=-3)}, "timeout=datetime.timedelta(days=-1, seconds=86397)"),
    (LLMParallelStrategy, {"timeout": "10m"}, "timeout='10m'"),
    (LLMParallelStrategy, {"compile_blocks": "no"}, "compile_blocks='no'"),
    (LLMParallelStrategy, {"compile_blocks": 2}, "compile_blocks=2"),
    (LLMParallelStrategy, {"compile_blocks": "max-autotune"}, "compile_blocks='max-autotune'"),
    (LLMParallelStrategy, {"cpu_offload": "true"}, "cpu_offload='true'"),
    (LLMParallelStrategy, {"save_distributed_checkpoint": "false"}, "save_distributed_checkpoint='false'"),
    (LLMParallelStrategy, {"fp8_exclude": "*.down_proj"}, "fp8_exclude='*.down_proj'"),
    (LLMParallelStrategy, {"tensor_parallel_replicate": "*.router"}, "tensor_parallel_replicate='*.router'"),
    (LLMParallelStrategy, {"pipeline_schedule": "Foo"}, "pipeline_schedule='Foo'"),
    (LLMParallelStrategy, {"accumulation_sync": "never"}, "accumulation_sync='never'"),
    (LLMParallelStrategy, {"fault_tolerance": "diloko"}, "fault_tolerance='diloko'"),
    (LLMParallelStrategy, {"fault_tolerance": 1}, "fault_tolerance=1"),
    (LLMParallelStrategy, {"fault_tolerance_sync_every": 0}, "fault_tolerance_sync_every=0"),
    (LLMParallelStrategy, {"fault_tolerance_sync_every": "10"}, "fault_tolerance_sync_every='10'"),
    (LossSpikeGuard, {"threshold": NAN}, "threshold=nan"),
    (LossSpikeGuard, {"threshold": INF}, "threshold=inf"),
    (LossSpikeGuard, {"threshold": "6"}, "threshold='6'"),
    (LossSpikeGuard, {"threshold": -2.0}, "threshold=-2.0"),
    (LossSpikeGuard, {"window": "100"}, "window='100'"),
    (LossSpikeGuard, {"window": 1}, "window=1"),
    (LossSpikeGuard, {"warmup_steps": True}, "warmup_steps=True"),
    (LossSpikeGuard, {"warmup_steps": -1}, "warmup_steps=-1"),
    (LossSpikeGuard, {"action": "pause"}, "action='pause'"),
    (RankWatchdog, {"timeout": -1}, "timeout=-1"),
    (RankWatchdog, {"timeout": NAN}, "timeout=nan"),
    (CheckpointRotation, {"every_n_train_steps": "5"}, "every_n_train_steps='5'"),
    (CheckpointRotation, {"every_n_train_steps": 0}, "every_n_train_steps=0"),
    (CheckpointRotation, {"keep_last": 2.5}, "keep_last=2.5"),
    (CheckpointRotation, {"every_n_minutes": "10"}, "every_n_minutes='10'"),
    (CheckpointRotation, {"async_save": "no"}, "async_save='no'"),
    (CheckpointRotation, {"save_on_train_end": "false"}, "save_on_train_end='false'"),
    (CheckpointRotation, {"dirpath": ""}, "dirpath=''"),
    (GradNormMonitor, {"log_every_n_steps": "5"}, "log_every_n_steps='5'"),
    (GradNormMonitor, {"norm_type": NAN}, "norm_type=nan"),
    (MFUMonitor, {"log_every_n_steps": 0}, "log_every_n_steps=0"),
    (MFUMonitor, {"peak_flops": "989e12"}, "peak_flops='989e12'"),
    (LLMDataModule, {"source": "parquet", "path": "train.parquet"}, "source='parquet'"),
    (LLMDataModule, {"seq_len": 0}, "seq_len=0"),
    (LLMDataModule, {"seq_len": -128}, "seq_len=-128"),
    (LLMDataModule, {"seq_len": "128"}, "seq_len='128'"),
    (LLMDataModule, {"batch_size": 0}, "batch_size=0"),
    (LLMDataModule, {"batch_size": 8.0}, "batch_size=8.0"),
    (LLMDataModule, {"val_fraction": 1.0}, "val_fraction=1.0"),
    (LLMDataModule, {"val_fraction": NAN}, "val_fraction=nan"),
    (LLMDataModule, {"num_tokens": 1}, "num_tokens=1"),
    (LLMDataModule, {"branching": 300, "vocab_size": 256}, "branching=300"),
    (LLMDataModule, {"num_workers": -1}, "num_workers=-1"),
    (LLMDataModule, {"token_dtype": "int8", "source": "tokens", "path": "x.bin"}, "token_dtype='int8'"),
    (LLMDataModule, {"source": "text"}, "path=None"),
    (LLMDataModule, {"shuffle": "false"}, "shuffle='false'"),
    (LLMDataModule, {"return_document_ids": True}, "source='synthetic'"),
    (LLMDataModule, {"return_document_ids": "yes", "source": "tokens", "path": "x.bin"}, "return_document_ids='yes'"),
    (LLMDataModule, {"val_path": "val.bin"}, "val_path='val.bin'"),
    (LLMDataModule, {"val_path": [], "source": "tokens", "path": "x.bin"}, "val_path=[]"),
    (LlamaConfig, {"dim": 60, "n_heads": 4, "n_kv_heads": 2}, "head_dim=15"),
    (LlamaConfig, {"dim": 96, "n_heads": 32, "n_kv_heads": 8}, "head_dim=3"),
]


def _each(factory, fields, bad_values, **fixed):
    """One case per (field, bad value): the error must name ``field=value``."""
    return [(factory, {**fixed, f: v}, f"{f}={v!r}") for f in fields for v in bad_values]


# Every field of the reference model's config and hyperparameters, and the flags and names of strategies and
# callbacks: a string, a float, a bool or an out-of-range number where an int, a number or a flag belongs.
FIELD_CASES = [
    *_each(LlamaConfig, ["vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"], ["64", 0, 2.5, True]),
    *_each(LlamaConfig, ["n_kv_heads", "ffn_hidden_dim"], ["2", 0, 1.5]),
    *_each(LlamaConfig, ["n_experts", "n_shared_experts", "n_dense_layers"], ["4", -1, 1.5]),
    *_each(LlamaConfig, ["top_k"], ["2", 0]),
    *_each(LlamaConfig, ["rope_theta", "norm_eps"], ["1e4", 0.0, -1.0, NAN]),
    *_each(LlamaConfig, ["init_std", "moe_aux_loss_coef"], ["0.02", -0.5, INF]),
    *_each(LlamaConfig, ["tie_embeddings"], ["false", 1]),
    *_each(CausalLM, ["learning_rate", "weight_decay"], ["3e-4", -1.0, NAN]),
    *_each(CausalLM, ["warmup_steps"], ["100", -1, 2.5]),
    *_each(CausalLM, ["max_steps"], [0, "1000"]),
    *_each(CausalLM, ["min_lr_ratio"], [1.5, -0.1]),
    (CausalLM, {"betas": (0.9, 1.0)}, "betas[1]=1.0"),
    (CausalLM, {"betas": (0.9,)}, "betas=(0.9,)"),
    (CausalLM, {"betas": ("0.9", 0.95)}, "betas[0]='0.9'"),
    (CausalLM, {"config": 3}, "config=3"),
    (CausalLM, {"config": "gigantic"}, "'gigantic'"),
    *_each(GradNormMonitor, ["per_block", "per_param_group"], ["yes", 1]),
    *_each(MFUMonitor, ["shifted_targets", "prog_bar"], ["false", 0]),
    (CheckpointRotation, {"mode": "maximum", "monitor": "val_loss"}, "mode='maximum'"),
    (CheckpointRotation, {"monitor": 3}, "monitor=3"),
    (CheckpointRotation, {"monitor": ""}, "monitor=''"),
    (CheckpointRotation, {"verify": "crc"}, "verify='crc'"),
    (CheckpointRotation, {"keep_best": 2}, "keep_best=2"),
    (LLMParallelStrategy, {"tensor_parallel_plan": "colwise"}, "tensor_parallel_plan='colwise'"),
    (LLMParallelStrategy, {"tensor_parallel_plan": {"*.c_attn": "qkv"}}, "'qkv'"),
    (LLMParallelStrategy, {"tensor_parallel_plan": {"*.c_attn": 1}}, "style 1"),
    (LLMParallelStrategy, {"pipeline_split": "layers.0", "pipeline_parallel_size": 2}, "pipeline_split='layers.0'"),
    (LLMParallelStrategy, {"pipeline_split": [["layers.0"], "layers.1"]}, "pipeline_split=[['layers.0'], 'layers.1']"),
    (LLMParallelStrategy, {"process_group_backend": 3}, "process_group_backend=3"),
    (LLMParallelStrategy, {"process_group_backend": ""}, "process_group_backend=''"),
    (LLMParallelStrategy, {"load_pretrained": 3}, "load_pretrained=3"),
    (LLMParallelStrategy, {"micro_batch_size": 0}, "micro_batch_size=0"),
    (LLMParallelStrategy, {"seq_len": "2048"}, "seq_len='2048'"),
    (LLMParallelStrategy, {"accumulation_sync": True}, "accumulation_sync=True"),
    (LLMParallelStrategy, {"expert_parallel_plan": "experts"}, "expert_parallel_plan='experts'"),
    (LLMParallelStrategy, {"expert_parallel_size": 0}, "expert_parallel_size=0"),
    (LLMParallelStrategy, {"context_parallel_size": "2"}, "context_parallel_size='2'"),
    (LLMParallelStrategy, {"context_parallel_method": "rings"}, "context_parallel_method='rings'"),
    (LLMParallelStrategy, {"fp8": "fp4"}, "fp8='fp4'"),
    (LLMParallelStrategy, {"activation_checkpointing": "partial"}, "activation_checkpointing='partial'"),
    (LLMParallelStrategy, {"activation_checkpointing_options": {"budgets": 0.3}}, "['budgets']"),
    (LLMDataModule, {"path": "train.bin"}, "path='train.bin'"),
    (LLMDataModule, {"source": "tokens", "path": 3}, "path=3"),
    (LLMDataModule, {"source": "tokens", "path": [3]}, "path=[3]"),
    (LLMDataModule, {"source": "text", "path": ""}, "path=''"),
    (LLMDataModule, {"seed": -1}, "seed=-1"),
    (LLMDataModule, {"markov_order": 0}, "markov_order=0"),
    (LLMDataModule, {"vocab_size": 2**33}, "vocab_size=8589934592"),
]


@pytest.mark.parametrize(
    "factory, kwargs, named",
    CONSTRUCTOR_CASES + FIELD_CASES,
    ids=[f"{f.__name__}-{named}" for f, _, named in CONSTRUCTOR_CASES + FIELD_CASES],
)
def test_constructor_refuses(factory, kwargs, named):
    with pytest.raises((TypeError, ValueError)) as error:
        factory(**kwargs)
    assert named in str(error.value), str(error.value)


class _CountSteps(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


def _write(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    return str(path)


def _fake_sharded_checkpoint(root: Path) -> str:
    (root / "dcp.ckpt").mkdir()
    (root / "dcp.ckpt" / ".metadata").write_bytes(b"")
    return str(root / "dcp.ckpt")


def _garbage_directory(root: Path) -> str:
    (root / "garbage.ckpt").mkdir()
    (root / "garbage.ckpt" / "junk.bin").write_bytes(b"\x00" * 64)
    return str(root / "garbage.ckpt")


def _token_file(root: Path) -> str:
    tokens = np.arange(4_000, dtype=np.uint16) % 300  # ids up to 299 for a model with 256
    tokens.tofile(root / "ids.bin")
    return str(root / "ids.bin")


def _uint32_file(root: Path) -> str:
    """32-bit ids, no sidecar: read as uint16, every second id is 0 and the rest fit any vocabulary."""
    (np.arange(4_000, dtype=np.uint32) % 250).tofile(root / "ids32.bin")
    return str(root / "ids32.bin")


def _uint16_file(root: Path) -> str:
    """16-bit ids, no sidecar: read as uint32, each pair of ids becomes one id past 65535."""
    (np.arange(4_000, dtype=np.uint16) % 250).tofile(root / "ids16.bin")
    return str(root / "ids16.bin")


def _file_beyond_its_sidecar(root: Path) -> str:
    """ids up to 249 (they fit the model's 256) with a sidecar saying the tokenizer had 100."""
    from lightning_llm.data.token_files import TokenFileInfo, write_token_info

    path = root / "other.bin"
    (np.arange(4_000, dtype=np.uint16) % 250).tofile(path)
    write_token_info(path, TokenFileInfo("uint16", 100, 0, None, 1, 4_000))
    return str(path)


# (data arguments given the tmp dir, unused, the text naming the bad value: a string, or several that must all appear)
FIT_CASES = {
    "token id >= vocab (synthetic)": (lambda d: {"vocab_size": 512}, None, "token id 511"),
    "token id >= vocab (file)": (lambda d: {"source": "tokens", "path": _token_file(d)}, None, "token id 299"),
    "seq_len > max_seq_len": (lambda d: {"seq_len": 300}, None, "seq_len=300"),
    "empty text file": (lambda d: {"source": "text", "path": _write(d / "empty.txt", b"")}, None, "empty.txt"),
    "non-UTF-8 text file": (
        lambda d: {"source": "text", "path": _write(d / "latin1.txt", "café".encode("latin-1") * 99)},
        None,
        "latin1.txt",
    ),
    "missing text file": (lambda d: {"source": "text", "path": str(d / "nowhere.txt")}, None, "nowhere.txt"),
    "uint32 ids read as uint16": (
        lambda d: {"source": "tokens", "path": _uint32_file(d), "token_dtype": "uint16"},
        None,
        ("ids32.bin looks like 32-bit token ids read as uint16", "Set token_dtype='uint32'"),
    ),
    "uint32 ids read as the default uint16": (
        lambda d: {"source": "tokens", "path": _uint32_file(d)},
        None,
        ("ids32.bin", "(the default without a sidecar)", "token_dtype='uint32'"),
    ),
    "uint16 ids read as uint32": (
        lambda d: {"source": "tokens", "path": _uint16_file(d), "token_dtype": "uint32"},
        None,
        ("ids16.bin (read as uint32)", "set token_dtype='uint16'"),
    ),
    "empty token file": (
        lambda d: {"source": "tokens", "path": _write(d / "empty.bin", b"")},
        None,
        ("empty.bin is empty", "prepare it again"),
    ),
    "ids beyond the sidecar's vocabulary": (
        lambda d: {"source": "tokens", "path": _file_beyond_its_sidecar(d)},
        None,
        ("other.bin holds token id 249, but its sidecar says vocab_size=100", "Prepare the data again"),
    ),
}


@pytest.mark.parametrize("case", list(FIT_CASES))
def test_fit_refuses_before_the_first_step(case, tmp_path):
    data_kwargs, _ckpt, named = FIT_CASES[case]
    steps = _CountSteps()
    trainer = cpu_trainer(
        max_steps=1,
        callbacks=[steps],
        default_root_dir=tmp_path,
    )
    data = LLMDataModule(**{"num_tokens": 2_000, "seq_len": 32, "batch_size": 2, **data_kwargs(tmp_path)})
    with pytest.raises((TypeError, ValueError, FileNotFoundError)) as error:
        trainer.fit(CausalLM("tiny"), data)
    for text in (named,) if isinstance(named, str) else named:
        assert text in str(error.value), str(error.value)
    assert steps.steps == 0


def _config(tmp_path: Path, **strategy) -> str:
    config = yaml.safe_load((CONFIGS / "tiny_tp2_zero3.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(strategy)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# (arguments after `lightning-llm plan` given the tmp dir, the text naming the bad value, exit code)
PLAN_CASES = {
    "devices 0": (lambda d: ["--config", _config(d), "--devices", "0"], "--devices=0", 2),
    "devices -8": (lambda d: ["--config", _config(d), "--devices=-8"], "--devices=-8", 2),
    "num_nodes 0": (lambda d: ["--config", _config(d), "--num_nodes", "0"], "--num_nodes=0", 2),
    "margin -1": (lambda d: ["--config", _config(d), "--margin=-1"], "--margin=-1.0", 2),
    "margin 1": (lambda d: ["--config", _config(d), "--margin", "1"], "--margin=1.0", 2),
    "margin nan": (lambda d: ["--config", _config(d), "--margin", "nan"], "--margin=nan", 2),
    "device_memory -80GB": (lambda d: ["--config", _config(d), "--device_memory=-80GB"], "-80GB", 2),
    "3 devices with tp 2": (lambda d: ["--config", _config(d), "--devices", "3"], "3 devices", 2),
    "tp 3 for 4 heads": (
        lambda d: ["--config", _config(d, tensor_parallel_size=3), "--devices", "3"],
        "tensor_parallel_size=3",
        2,
    ),
    "tp 64": (
        lambda d: ["--config", _config(d, tensor_parallel_size=64), "--devices", "64"],
        "tensor_parallel_size=64",
        2,
    ),
    "pp 100 on 2 blocks": (
        lambda d: [
            "--config",
            _config(d, tensor_parallel_size=1, sequence_parallel=False, pipeline_parallel_size=100),
            "--devices",
            "100",
        ],
        "pipeline_parallel_size=100",
        2,
    ),
    "pp 3 on 2 blocks": (
        lambda d: [
            "--config",
            _config(d, tensor_parallel_size=1, sequence_parallel=False, pipeline_parallel_size=3),
            "--devices",
            "3",
        ],
        "pipeline_parallel_size=3 is more than the model's 2 blocks",
        2,
    ),
    "nothing fits": (lambda d: ["--config", _config(d), "--devices", "2", "--device_memory", "1MB"], "1MB", 1),
    # Refused by fit at setup, so by plan too (one set of checks).
    "pp 2 x 4 virtual stages on 2 blocks": (
        lambda d: [
            "--config",
            _config(
                d,
                tensor_parallel_size=1,
                sequence_parallel=False,
                pipeline_parallel_size=2,
                pipeline_schedule="Interleaved1F1B",
                virtual_stages=4,
            ),
            "--devices",
            "2",
        ],
        "8 pipeline stages need at least as many transformer blocks, but the model has 2",
        2,
    ),
    "a binary config": (
        lambda d: ["--config", _write(d / "binary.yaml", bytes(range(256)))],
        "binary.yaml is not UTF-8 text (byte 0x80 at offset 128)",
        2,
    ),
    "a missing config": (lambda d: ["--config", str(d / "absent.yaml")], "absent.yaml does not exist", 2),
    "a config that is a list": (
        lambda d: ["--config", _write(d / "list.yaml", b"- trainer\n- model\n")],
        "list.yaml holds a list, not a mapping",
        2,
    ),
    "replicate 3 on 8 devices": (
        lambda d: [
            "--config",
            _config(d, tensor_parallel_size=1, sequence_parallel=False, data_parallel_replicate_size=3),
            "--devices",
            "8",
        ],
        "data_parallel_replicate_size=3 does not divide the data-parallel size 8",
        2,
    ),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_refuses(case, tmp_path, capsys):
    args, named, code = PLAN_CASES[case]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *args(tmp_path)])
    assert exit_.value.code == code
    captured = capsys.readouterr()
    assert named in captured.out + captured.err, captured.out + captured.err


FIT_CLI_CASES = {
    "data.seq_len 0": (["--data.seq_len", "0"], "seq_len=0"),
    "data.source parquet": (["--data.source", "parquet"], "parquet"),
    "data.batch_size -4": (["--data.batch_size", "-4"], "batch_size=-4"),
    "model.config unknown": (["--model.config", "huge"], "huge"),
}


CKPT_CASES = {
    "garbage directory": (_garbage_directory, "garbage.ckpt"),
    "sharded checkpoint, single device": (_fake_sharded_checkpoint, "dcp.ckpt"),
}


@pytest.mark.parametrize("case", list(CKPT_CASES))
def test_cli_fit_refuses_a_checkpoint_directory_it_cannot_read(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make, named = CKPT_CASES[case]
    steps = _CountSteps()
    with pytest.raises(ValueError, match=named):
        LLMCLI(
            args=[
                "fit",
                "--trainer.logger",
                "false",
                "--trainer.max_steps",
                "1",
                "--trainer.accelerator",
                "cpu",
                "--data.num_tokens",
                "2000",
                "--data.seq_len",
                "32",
                "--ckpt_path",
                make(tmp_path),
            ],
            trainer_defaults={"callbacks": [steps]},
        )
    assert steps.steps == 0


@pytest.mark.parametrize("case", list(FIT_CLI_CASES))
def test_cli_fit_refuses_before_training(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args, named = FIT_CLI_CASES[case]
    with pytest.raises((SystemExit, TypeError, ValueError, KeyError)) as error:
        LLMCLI(args=["--trainer.logger", "false", *args], run=False)
    captured = capsys.readouterr()
    assert named in str(error.value) + captured.err, str(error.value) + captured.err


def test_every_checked_strategy_option_has_a_case():
    """An option added to lightning_llm/strategies/parallel_options.py with a check needs a bad value here."""
    from lightning_llm.strategies.declarations import declarations
    from lightning_llm.strategies.parallel_options import StrategyOptions

    named = {k for f, kwargs, text in CONSTRUCTOR_CASES + FIELD_CASES if f is LLMParallelStrategy for k in kwargs}
    accepts_anything = {"blocks"}  # a name, names or a callable: what it names is found (or refused) at setup
    assert {d.argument for d in declarations(StrategyOptions)} - accepts_anything <= named


def test_there_are_at_least_200_cases():
    tables = (CONSTRUCTOR_CASES, FIELD_CASES, FIT_CASES, PLAN_CASES, FIT_CLI_CASES, CKPT_CASES, FILE_CASES)
    assert sum(map(len, tables)) >= 200


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"num_microbatches": 4}, "num_microbatches=4 ignored: pipeline_parallel_size=1"),
        ({"layout_rates": "H100"}, "layout_rates='H100' ignored: it applies to layout='auto'"),
        ({"pipeline_split": [["a"], ["b"]]}, "pipeline_split=[['a'], ['b']] ignored"),
        (
            {"activation_checkpointing": "full", "activation_checkpointing_options": {"selective": "layer"}},
            "activation_checkpointing_options={'selective': 'layer'} ignored",
        ),
    ],
)
def test_options_the_mode_ignores_are_warned_about(kwargs, named):
    with pytest.warns(UserWarning, match=named.replace("[", r"\[").replace("]", r"\]")):
        LLMParallelStrategy(**kwargs)


def test_a_path_object_is_a_valid_checkpoint_dirpath(tmp_path):
    assert CheckpointRotation(dirpath=tmp_path / "ckpts").dirpath.endswith("ckpts")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(a reference-model .ckpt, its Hugging Face export): the good files the file cases below damage."""
    tmp = tmp_path_factory.mktemp("files")
    module = CausalLM("tiny")
    module.configure_model()
    ckpt = tmp / "model.ckpt"
    state = {f"model.{k}": v for k, v in module.model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"config": module.config}}, ckpt)
    main(["export", str(ckpt), str(tmp / "hf"), "--format", "hf"])
    return ckpt, tmp / "hf"


def _damaged_hf(tmp: Path, hf: Path, damage) -> Path:
    copy = tmp / "damaged"
    shutil.copytree(hf, copy)
    damage(copy)
    return copy


def _load(directory) -> None:
    from lightning_llm.hf.load import load_pretrained

    module = CausalLM("tiny")
    module.configure_model()
    load_pretrained(module, directory)


def _cli(*args: str) -> None:
    main(list(args))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail (EFBIG) as on a full disk, for this process, even as root."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's signal ends the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _export_failing_write(t: Path, c: Path, *args: str) -> None:
    with _file_size_limit(128 * 1024):  # the tiny model: 525 KB of weights (260 KB in bf16); logs stay below
        _cli("export", str(c), str(t / "out"), *args)


# (what to run given (tmp, ckpt, hf), the text the error must hold): damaged or misplaced files, each named.
FILE_CASES = {
    "truncated safetensors": (
        lambda t, c, h: _load(_damaged_hf(t, h, lambda d: _truncate(d / "model.safetensors"))),
        "model.safetensors cannot be read as safetensors",
    ),
    "index that is not JSON": (
        lambda t, c, h: _load(
            _damaged_hf(
                t,
                h,
                lambda d: (d / "model.safetensors").unlink() or (d / "model.safetensors.index.json").write_text("{x"),
            )
        ),
        "model.safetensors.index.json is not a safetensors index",
    ),
    "config.json missing": (
        lambda t, c, h: _load(_damaged_hf(t, h, lambda d: (d / "config.json").unlink())),
        "config.json is missing",
    ),
    "load_pretrained from a URL": (lambda t, c, h: _load("memory://bucket/model"), "'memory://bucket/model' is a URL"),
    "load_pretrained from an empty folder": (
        lambda t, c, h: _load(t),
        "holds neither model.safetensors nor model.safetensors.index.json",
    ),
    "export a text file": (
        lambda t, c, h: (t / "notes.txt").write_text("hello") and _cli("export", str(t / "notes.txt"), str(t / "o")),
        "notes.txt is not a readable torch checkpoint",
    ),
    "export a Hugging Face folder": (
        lambda t, c, h: _cli("export", str(h), str(t / "o")),
        "is neither a checkpoint file, a sharded checkpoint directory",
    ),
    "export crafted DCP metadata": (
        lambda t, c, h: (t / ".metadata").write_bytes(b"\x80\x04garbage") and _cli("export", str(t), str(t / "o")),
        ".metadata is not DCP checkpoint metadata",
    ),
    "export under a file": (
        lambda t, c, h: (t / "afile").write_text("x") and _cli("export", str(c), str(t / "afile" / "o")),
        "afile is a file, not a folder",
    ),
    "export --format torch of a torch file that is not a Lightning checkpoint": (
        lambda t, c, h: (
            torch.save({"a": 1}, t / "a.pt") or _cli("export", str(t / "a.pt"), str(t / "o"), "--format", "torch")
        ),
        "a.pt holds no 'state_dict' entry, so it is not a Lightning checkpoint (it holds a dict with keys ['a'])",
    ),
    "export --format torch, the write fails": (
        lambda t, c, h: _export_failing_write(t, c, "--format", "torch"),
        "out could not be written: File too large (EFBIG",
    ),
    "export --format torch --dtype, the write fails inside torch.save": (
        lambda t, c, h: _export_failing_write(t, c, "--format", "torch", "--dtype", "bfloat16"),
        "out could not be written: RuntimeError: [enforce fail at inline_container.cc",
    ),
    "export --format hf, the write fails": (
        lambda t, c, h: _export_failing_write(t, c, "--format", "hf"),
        "out could not be written: SafetensorError",
    ),
    "export onto an existing output": (
        lambda t, c, h: _cli("export", str(c), str(h), "--format", "hf"),
        "exists; pass --overwrite to replace it",
    ),
    "prepare into a file": (
        lambda t, c, h: (
            (t / "afile").write_text("x")
            and (t / "a.txt").write_text("text")
            and _cli("prepare", str(t / "a.txt"), "--output_dir", str(t / "afile"))
        ),
        "is a file, not a folder",
    ),
    "prepare with a missing tokenizer": (
        lambda t, c, h: (
            (t / "a.txt").write_text("text")
            and _cli("prepare", str(t / "a.txt"), "--output_dir", str(t / "out"), "--tokenizer", str(t / "tok.json"))
        ),
        "Tokenizer not found",
    ),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_damaged_or_misplaced_files_are_named(case, exported, tmp_path, capsys):
    run, named = FILE_CASES[case]
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as error:
        run(tmp_path, *exported)
    message = str(error.value) + capsys.readouterr().err
    assert named in message, message


def test_export_that_failed_to_write_leaves_nothing_behind(exported, tmp_path):
    with pytest.raises(SystemExit):
        _export_failing_write(tmp_path, exported[0], "--format", "torch", "--dtype", "bfloat16")
    assert list(tmp_path.iterdir()) == []


def test_a_stale_index_beside_a_single_safetensors_file_is_ignored_as_transformers_does(exported, tmp_path):
    """A sharded save's index left beside a newer single-file save names shards that are gone: the single file is
    the model (transformers' from_pretrained loads it too)."""
    import json

    from transformers import AutoModelForCausalLM

    stale = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    directory = _damaged_hf(
        tmp_path, exported[1], lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(stale))
    )
    AutoModelForCausalLM.from_pretrained(directory)  # the oracle: transformers reads model.safetensors
    _load(directory)
