"""Where zero_stage="auto" gets the micro-batch shape: the strategy's arguments, the datamodule, the first batch."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.strategies.zero_auto import planning_inputs

CPU = torch.device("cpu")


def _trainer(loader=None, datamodule=None):
    # What planning_inputs reads: the datamodule, else the loader handed to fit() (Lightning's data source).
    return SimpleNamespace(
        datamodule=datamodule, fit_loop=SimpleNamespace(_data_source=SimpleNamespace(dataloader=lambda: loader))
    )


def test_a_plain_dataloader_gives_the_shape_of_its_first_batch():
    loader = DataLoader(torch.zeros(10, 33, dtype=torch.long), batch_size=3)
    assert planning_inputs(_trainer(loader), CPU, 2**30, None, None) == {
        "device_memory": 2**30,
        "micro_batch_size": 3,
        "seq_len": 33,
        "documents": False,
    }


def test_a_datamodule_returning_document_ids_plans_document_masked_attention():
    class Packed(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"batch_size": 2, "seq_len": 8, "return_document_ids": True})

    inputs = planning_inputs(_trainer(datamodule=Packed()), CPU, 2**30, None, None)
    assert (inputs["micro_batch_size"], inputs["seq_len"], inputs["documents"]) == (2, 8, True)


def test_dict_batches_and_datamodules_without_hparams_are_read_too():
    rows = [{"input_ids": torch.zeros(17, dtype=torch.long), "label": 0} for _ in range(8)]

    class NoHparams(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(rows, batch_size=4)

    inputs = planning_inputs(_trainer(datamodule=NoHparams()), CPU, 2**30, None, None)
    assert (inputs["micro_batch_size"], inputs["seq_len"]) == (4, 17)


def test_the_strategys_arguments_come_first():
    loader = DataLoader(torch.zeros(10, 33, dtype=torch.long), batch_size=3)
    inputs = planning_inputs(_trainer(loader), CPU, 2**30, 5, 7)
    assert (inputs["micro_batch_size"], inputs["seq_len"]) == (5, 7)
    strategy = LLMParallelStrategy(zero_stage="auto", micro_batch_size=5, seq_len=7)
    assert (strategy.micro_batch_size, strategy.seq_len) == (5, 7)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        LLMParallelStrategy(zero_stage="auto", micro_batch_size=0)


def test_an_unreadable_loader_names_the_arguments_that_fix_it():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(9, dtype=torch.long)

    with pytest.raises(
        ValueError, match="could not read a training batch.*Pass micro_batch_size and seq_len to the strategy"
    ):
        planning_inputs(_trainer(DataLoader(Stream(), batch_size=2)), CPU, 2**30, None, None)
    flat = DataLoader(torch.zeros(10), batch_size=2)  # batches of shape (2,): no sequence dimension
    with pytest.raises(
        ValueError, match=r"no tensor of shape \(batch, sequence, ...\).*Pass micro_batch_size and seq_len"
    ):
        planning_inputs(_trainer(flat), CPU, 2**30, None, None)
