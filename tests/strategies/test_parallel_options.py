"""LLMParallelStrategy's options are declared once (lightning_llm/strategies/parallel_options.py): its signature,
the declarations, its docstring and the help LightningCLI prints agree, and the options are built by keyword only."""

from __future__ import annotations

import dataclasses
import inspect

import docstring_parser
import pytest
from jsonargparse import ArgumentParser

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.strategies.declarations import declarations
from lightning_llm.strategies.parallel_options import (
    CheckpointingOptions,
    ParallelOptions,
    PipelineOptions,
    PlanningOptions,
    StrategyOptions,
    build_options,
)

DECLARED = {d.argument: d for d in declarations(StrategyOptions)}
SIGNATURE = {n: p for n, p in inspect.signature(LLMParallelStrategy.__init__).parameters.items() if n != "self"}
RUN_STATE = ("zero_stage", "cpu_offload")  # the strategy's attributes hold what setup resolves "auto" to


def test_every_argument_is_declared_once_with_the_signatures_default_and_a_type():
    assert len(DECLARED) == len(list(declarations(StrategyOptions))), "an argument is declared twice"
    assert sorted(SIGNATURE) == sorted(DECLARED)
    for name, parameter in SIGNATURE.items():
        assert parameter.default == DECLARED[name].default, name
        assert parameter.annotation is not inspect.Parameter.empty, f"{name}: LightningCLI needs its type"


def test_the_docstring_documents_every_argument_as_declared_in_the_signatures_order():
    parsed = docstring_parser.parse(LLMParallelStrategy.__doc__)  # as jsonargparse reads it
    assert [p.arg_name for p in parsed.params] == list(SIGNATURE)
    for param in parsed.params:
        assert " ".join(param.description.split()) == DECLARED[param.arg_name].doc, param.arg_name
    assert "{arguments}" not in LLMParallelStrategy.__doc__


def test_lightning_cli_help_shows_every_arguments_documentation(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per argument: nothing wrapped
    parser = ArgumentParser()
    parser.add_class_arguments(LLMParallelStrategy, "strategy")
    help_text = " ".join(parser.format_help().split())
    for name, declaration in DECLARED.items():
        assert f"--strategy.{name} " in help_text, name
        assert declaration.doc in help_text, name


@pytest.mark.parametrize("group", [ParallelOptions, PipelineOptions, PlanningOptions, CheckpointingOptions])
def test_options_are_built_by_keyword_only(group):
    assert all(field.kw_only for field in dataclasses.fields(group))
    with pytest.raises(TypeError):
        group(*[None] * len(dataclasses.fields(group)))  # a reordered field cannot swap two options
    with pytest.raises(TypeError):
        build_options(1)


def test_each_option_is_a_read_only_attribute_of_the_strategy():
    strategy = LLMParallelStrategy(fp8=False, tensor_parallel_replicate=["*.router"], blocks=["a", "b"])
    for name, declaration in DECLARED.items():
        # Lightning's property: the backend the run uses; the contract's: the run's ParallelLayout ("auto" resolved)
        if name not in ("process_group_backend", "layout"):
            assert getattr(strategy, name) == declaration.read(strategy.options), name
    assert strategy.tensor_parallel_replicate == ["*.router"] and strategy.blocks == ("a", "b")
    assert strategy.ac_options is strategy.options.planning.ac_options
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.sequence_parallel = True
    strategy.zero_stage = 2  # run state, set by setup when "auto" resolves
    assert strategy.run_state.zero_stage == 2 and strategy.options.parallel.zero_stage == 3
    assert all(name in DECLARED for name in RUN_STATE)


def test_the_defaults_pass_their_checks_unchanged_where_no_normalization_is_declared():
    options = build_options(**{name: d.default for name, d in DECLARED.items()})
    assert options == LLMParallelStrategy().options
    assert options.parallel.fp8 is None and options.parallel.fp8_exclude == []  # False and None, normalized


def test_an_argument_without_a_declaration_is_refused_not_dropped():
    arguments = {name: d.default for name, d in DECLARED.items()}
    with pytest.raises(TypeError, match=r"declares no option \['tensor_parallel_sise'\]"):
        build_options(**arguments, tensor_parallel_sise=2)
    del arguments["seq_len"]
    with pytest.raises(TypeError, match=r"misses \['seq_len'\]"):
        build_options(**arguments)
