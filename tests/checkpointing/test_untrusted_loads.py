"""No code runs from a checkpoint: a payload planted in each file a checkpoint load reads (a ``.ckpt`` file,
Lightning's ``meta.pt``, DCP's ``.metadata``, a DCP byte entry, the ``hf_export`` class path) would create a marker
file if it ran; every load path refuses it naming the file, and the marker never appears."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader

from lightning_llm.cli import main as cli_main
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import cpu_trainer
from tests._payload import Payload

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).parents[2]


def _model() -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("tiny"))
    module.configure_model()
    return module


def _sharded(directory: Path, **extra) -> Path:
    """A sharded checkpoint as LLMParallelStrategy writes it: DCP shards + ``.metadata``, and ``meta.pt``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"state_dict": _model().state_dict(), **extra}, checkpoint_id=directory)
    torch.save({"global_step": 1, "hyper_parameters": {"config": LlamaConfig.from_name("tiny")}}, directory / "meta.pt")
    return directory


def _export(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", *args])
    assert exit_info.value.code != 0
    return capsys.readouterr().err


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "PAYLOAD_RAN"
    yield path
    assert not path.exists(), "a payload ran while loading a checkpoint"


def test_the_payloads_run_when_fully_unpickled(tmp_path):
    # The control: each test below would fail if the load it covers unpickled without restriction.
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": Payload(marker)}, tmp_path / "evil.ckpt")
    torch.load(tmp_path / "evil.ckpt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_resume_from_a_ckpt_file_under_the_strategy_refuses_the_payload(tmp_path, marker):
    from lightning_llm.strategies import LLMParallelStrategy

    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": _model().state_dict(), "loops": Payload(marker)}, evil)
    trainer = cpu_trainer(
        devices=1,
        strategy=LLMParallelStrategy(),
        max_steps=1,
    )
    tokens = DataLoader(torch.randint(0, 256, (4, 17)), batch_size=2)
    with pytest.raises(ValueError, match="evil.ckpt.*not a tensor or a plain value"):
        trainer.fit(CausalLM(LlamaConfig.from_name("tiny")), tokens, ckpt_path=evil)


def test_consolidating_a_ckpt_file_refuses_the_payload(tmp_path, marker):
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "callbacks": Payload(marker)}, evil)
    run = subprocess.run(
        [sys.executable, "-m", "lightning_llm.checkpoint", str(evil), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode != 0
    assert f"{evil} holds a pickled object that is not a tensor or a plain value" in run.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_export_of_a_ckpt_file_refuses_the_payload(tmp_path, marker, capsys, fmt):
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": _model().state_dict(), "hyper_parameters": Payload(marker)}, evil)
    err = _export([str(evil), str(tmp_path / "out"), "--format", fmt], capsys)
    assert f"{evil} holds a pickled object that is not a tensor or a plain value" in err


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_export_of_a_sharded_directory_refuses_a_crafted_meta_pt(tmp_path, marker, capsys, fmt):
    checkpoint = _sharded(tmp_path / "step=1.ckpt")
    torch.save({"global_step": 1, "hyper_parameters": Payload(marker)}, checkpoint / "meta.pt")
    err = _export([str(checkpoint), str(tmp_path / "out"), "--format", fmt], capsys)
    assert f"{checkpoint / 'meta.pt'} holds a pickled object" in err


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_export_of_a_sharded_directory_refuses_a_crafted_dcp_metadata(tmp_path, marker, capsys, fmt):
    checkpoint = _sharded(tmp_path / "step=1.ckpt")
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    err = _export([str(checkpoint), str(tmp_path / "out"), "--format", fmt], capsys)
    assert f"{checkpoint / '.metadata'} is not DCP checkpoint metadata" in err
    assert "pathlib.Path.touch is not part of DCP's checkpoint metadata" in err


def test_resume_from_a_sharded_directory_refuses_a_crafted_dcp_metadata(tmp_path, marker):
    from lightning_llm.strategies import LLMParallelStrategy

    checkpoint = _sharded(tmp_path / "step=1.ckpt")
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    trainer = cpu_trainer(
        devices=1,
        strategy=LLMParallelStrategy(),
        max_steps=1,
    )
    tokens = DataLoader(torch.randint(0, 256, (4, 17)), batch_size=2)
    with pytest.raises(ValueError, match=r"\.metadata is not DCP checkpoint metadata"):
        trainer.fit(CausalLM(LlamaConfig.from_name("tiny")), tokens, ckpt_path=checkpoint)


def test_export_refuses_a_payload_in_a_dcp_byte_entry(tmp_path, marker, capsys):
    # DCP stores non-tensor values as torch.save bytes inside the shards; torch's planner loads them unrestricted.
    checkpoint = _sharded(tmp_path / "step=1.ckpt", extra=Payload(marker))
    err = _export([str(checkpoint), str(tmp_path / "out.pt"), "--format", "torch"], capsys)
    assert f"{checkpoint} (entry 'extra') holds a pickled object" in err


@pytest.mark.parametrize("class_path", ["planted_payload_module.Model", "os.system", "transformers.AutoConfig"])
def test_export_refuses_an_hf_export_class_outside_the_allow_list(tmp_path, marker, capsys, monkeypatch, class_path):
    # Importing the planted module would run its top level; the class path must never reach an import.
    (tmp_path / "planted_payload_module.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoint = _sharded(tmp_path / "step=1.ckpt")
    entry = {"kind": "transformers", "prefix": "model.", "class": class_path, "config": json.dumps({})}
    torch.save({"global_step": 1, "hf_export": entry}, checkpoint / "meta.pt")
    err = _export([str(checkpoint), str(tmp_path / "out"), "--format", "hf"], capsys)
    assert f"The 'hf_export' entry of {checkpoint} names the model class {class_path!r}" in err
    assert "planted_payload_module" not in sys.modules


def test_a_deepspeed_checkpoint_scan_names_a_planted_payload_and_passes_deepspeeds_own_classes(tmp_path, marker):
    # The scan LLMDeepSpeedStrategy runs before DeepSpeed's full unpickler opens any file (the strategy path itself:
    # tests/strategies/test_deepspeed.py::test_resume_refuses_a_payload_planted_in_a_deepspeed_file...).
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="DeepSpeed is optional")
    from lightning_llm.checkpointing.deepspeed import unsafe_pickle_refusal

    states = tmp_path / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    states.parent.mkdir()
    torch.save({"loss_scaler": loss_scaler.LossScaler(1.0), "state": {"exp_avg": torch.zeros(2)}}, states)
    assert unsafe_pickle_refusal(tmp_path) is None
    torch.save({"loss_scaler": loss_scaler.LossScaler(1.0), "planted": Payload(marker)}, states)
    refusal = unsafe_pickle_refusal(tmp_path)
    assert refusal is not None and str(states) in refusal and "builtins.getattr" in refusal, refusal
