"""Activation checkpointing: exact gradients in every mode (one process, FSDP2 and TP), recomputation
proven by exact FLOP counts, per-block memory measured, the "auto" budget respected, bad input refused."""

import copy
import logging
from functools import cache

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.activations import measure_block_activations, measure_blocks
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.llama import rotary_tables
from lightning_llm.parallel.activation_checkpointing import (
    ACOptions,
    apply_activation_checkpointing,
    is_checkpointed,
    saves_output,
)
from lightning_llm.planning.activation_budget import plan_for_budget, predicted_peak, resolve_budget
from lightning_llm.testing import run_distributed
from lightning_llm.testing.models import HFCausalLM, UserLM

LAYERS = 4
BATCH = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
MODES = {
    "full": {"mode": "full"},
    "op": {"mode": "selective", "selective": "op"},
    "op-every-other-mm": {"mode": "selective", "selective": "op", "recompute_every_other_matmul": True},
    "layer": {"mode": "selective", "selective": "layer", "every_n_layers": 2},
    "auto": {"mode": "auto"},  # budget: halfway between full and no checkpointing, see _options
}


def _model(arch="reference"):
    torch.manual_seed(0)
    if arch == "reference":
        module = CausalLM(LlamaConfig.from_name("tiny", n_layers=LAYERS))
        module.configure_model()
    elif arch == "hf_llama":
        module = HFCausalLM("llama", layers=LAYERS)
    else:
        module = UserLM(layers=LAYERS)
    module.log = lambda *args, **kwargs: None
    return module


def _blocks(module):
    return find_blocks(module)[1]


def _halfway_budget(module, batch):
    sizes = measure_blocks(_blocks(module), lambda: module.training_step(batch, 0))
    saved, inputs = [s.saved for s in sizes], [s.input for s in sizes]
    return (predicted_peak(saved, inputs) + predicted_peak(saved, saved)) // 2


def _options(label, module, batch=BATCH):
    options = dict(MODES[label])
    if label == "auto":
        options.update(budget=_halfway_budget(module, batch), measure_fn=lambda: module.training_step(batch, 0))
    return options


def _loss_and_grads(module, batch=BATCH):
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), {n: _full(p.grad) for n, p in module.named_parameters()}


def _full(grad):
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


@cache
def _reference(arch):
    return _loss_and_grads(_model(arch))


def _assert_same(got, want, what):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("arch", ["reference", "hf_llama", "user"])
@pytest.mark.parametrize("label", MODES)
def test_every_mode_gives_the_same_loss_and_gradients(arch, label):
    module = _model(arch)
    names = list(module.state_dict())
    report = apply_activation_checkpointing(_blocks(module), **_options(label, module))
    expected = {"layer": ["full", "none"] * 2, "full": ["full"] * 4, "auto": report.policies}.get(label, ["op"] * 4)
    assert report.policies == expected and report.checkpointed > 0
    assert list(module.state_dict()) == names, "checkpointing must not rename parameters or buffers"
    _assert_same(_loss_and_grads(module), _reference(arch), f"{arch} {label}")


def test_a_pipeline_stage_counts_layers_from_its_first_block():
    module = _model()
    stage = list(_blocks(module))[1:]  # a stage holding blocks 1-3 of the model
    report = apply_activation_checkpointing(
        stage, mode="selective", selective="layer", every_n_layers=2, block_indices=[1, 2, 3]
    )
    assert report.policies == ["none", "full", "none"]
    assert [is_checkpointed(b) for b in _blocks(module)] == [False, False, True, False]
    _assert_same(_loss_and_grads(module), _reference("reference"), "stage")


def test_a_deep_copy_of_a_checkpointed_block_runs_its_own_weights():
    module = _model()
    apply_activation_checkpointing(_blocks(module), mode="full")
    block = _blocks(module)[0]
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    x, cos_sin = torch.randn(2, 8, 64), rotary_tables(8, 16, 1e4, torch.device("cpu"))
    assert not torch.allclose(twin(x, *cos_sin), block(x, *cos_sin))


def _backward(module, mode_counter):
    loss = module.training_step(BATCH, 0)
    with mode_counter as counter:
        loss.backward()
    return counter


def _backward_flops(label=None, fused_cross_entropy=True, **options):
    module = _model()
    module.fused_cross_entropy = fused_cross_entropy
    if label is not None:
        apply_activation_checkpointing(_blocks(module), **(options or _options(label, module)))
    return _backward(module, FlopCounterMode(display=False)).get_total_flops()


def test_recomputation_is_counted_exactly_from_the_matmul_flops():
    config, tokens = LlamaConfig.from_name("tiny", n_layers=LAYERS), BATCH.shape[0] * (BATCH.shape[1] - 1)
    heads, kv_heads = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    q, k, v, o = (2 * tokens * config.dim * width for width in (heads, kv_heads, kv_heads, heads))
    gate = up = down = 2 * tokens * config.dim * config.ffn_hidden_dim
    output = 2 * tokens * config.dim * config.vocab_size
    # torch's FLOP counter has no formula for CPU flash attention: matmuls alone are counted here.
    block = q + k + v + o + gate + up + down
    none = _backward_flops()
    # Each matmul's backward: two matmuls of its size. The chunked loss computes the head's two in the forward.
    assert none == 2 * LAYERS * block
    assert _backward_flops(fused_cross_entropy=False) == 2 * (LAYERS * block + output)
    # The op policy saves every matmul output: it recomputes only pointwise ops.
    assert _backward_flops("op") == none
    # Every other matmul of a block (k, o, up of q k v o gate up down) is recomputed.
    assert _backward_flops("op-every-other-mm") == none + LAYERS * (k + o + up)
    # Full recomputes the forward but its last matmul: nothing in the block saves down_proj's output,
    # and non-reentrant checkpointing stops once every tensor backward needs is back.
    assert _backward_flops("full") == none + LAYERS * (block - down)
    assert _backward_flops("layer") == none + LAYERS // 2 * (block - down)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run (those ``which(op)`` accepts)."""

    def __init__(self, which=lambda op: True):
        super().__init__()
        self.ops, self.which = 0, which

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += self.which(func)
        return func(*args, **(kwargs or {}))


def _peak_activations(module, step=None):
    """Peak bytes of activations and backward temporaries in one training step, tracked by MemTracker.

    Gradients are allocated beforehand, so at the peak of all tracked memory everything but
    parameters and gradients is activations and temporaries.
    """
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        (step or (lambda: module.training_step(BATCH, 0).backward()))()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if any(c in str(k) for c in ("ACT", "TEMP")))


@pytest.mark.parametrize("arch", ["reference", "user", "hf_llama"])
def test_measurement_counts_what_autograd_and_the_selective_policy_keep(arch):
    module = _model(arch)
    real = measure_blocks(_blocks(module), lambda: module.training_step(BATCH, 0), saves_output)
    fake = measure_block_activations(
        module, list(_blocks(module)), lambda: module.training_step(BATCH, 0), saves_output
    )
    hidden = BATCH.shape[0] * (BATCH.shape[1] - 1) * 64 * 4
    assert all(r.input == hidden and r.input < r.op < r.saved for r in real)
    assert [r.op for r in real] == [f.op for f in fake]
    if arch == "hf_llama":  # under fake tensors HF builds an explicit causal mask: an overestimate, never less
        assert all(r.saved < f.saved <= 1.2 * r.saved for r, f in zip(real, fake))
    else:
        assert [r.saved for r in real] == [f.saved for f in fake]
    # The prediction bounds what MemTracker sees in each mode, beyond what lives outside the blocks
    # (embeddings, logits, loss: the peak without checkpointing less the blocks' prediction).
    saved = [r.saved for r in real]
    outside = _peak_activations(_model(arch)) - predicted_peak(saved, saved)
    for label in ("full", "op", "layer"):
        module = _model(arch)
        report = apply_activation_checkpointing(_blocks(module), **MODES[label])
        kept = [{"none": r.saved, "op": r.op, "full": r.input}[p] for r, p in zip(real, report.policies)]
        measured = _peak_activations(module) - outside
        assert measured <= 1.001 * predicted_peak(saved, kept), label
        if label == "full":  # backward recomputes a block while the others hold their inputs: more than the inputs
            assert measured > sum(kept) + saved[-1] // 4


def test_the_measuring_pass_holds_one_block_at_a_time():
    module = _model()
    sizes = measure_blocks(_blocks(module), lambda: module.training_step(BATCH, 0))
    measuring = _peak_activations(
        module, lambda: measure_blocks(_blocks(module), lambda: module.training_step(BATCH, 0))
    )
    plain = _model()
    forward = _peak_activations(plain, lambda: plain.training_step(BATCH, 0))
    assert measuring < forward - 2 * sizes[0].saved


def test_auto_keeps_the_measured_peak_under_the_budget_and_recomputes_less_than_full():
    with pytest.raises(RuntimeError, match=r"measure_fn\(\) ran no forward through blocks \[0, 1, 2, 3\]"):
        measure_blocks(_blocks(_model()), lambda: _model().training_step(BATCH, 0))  # another model's blocks
    probe = _model()
    sizes = measure_blocks(_blocks(probe), lambda: probe.training_step(BATCH, 0))
    saved, inputs = [s.saved for s in sizes], [s.input for s in sizes]
    outside = _peak_activations(_model()) - predicted_peak(saved, saved)  # embeddings, logits, loss
    full = _model()
    apply_activation_checkpointing(_blocks(full), mode="full")
    full_ops, full_flops = (
        _backward(full, _OpCounter()).ops,
        _backward(full, FlopCounterMode(display=False)).get_total_flops(),
    )
    plans = []
    for fraction in (0.25, 0.5, 0.75):
        budget = int(
            predicted_peak(saved, inputs) + fraction * (predicted_peak(saved, saved) - predicted_peak(saved, inputs))
        )
        module = _model()
        report = apply_activation_checkpointing(
            _blocks(module), mode="auto", budget=budget, measure_fn=lambda: module.training_step(BATCH, 0)
        )
        assert report.predicted_bytes <= budget == report.budget_bytes and report.policies[-1] == "none"
        assert _peak_activations(module) - outside <= budget
        assert _backward(module, _OpCounter()).ops < full_ops
        assert _backward(module, FlopCounterMode(display=False)).get_total_flops() <= full_flops
        plans.append(report.policies)
    # A larger budget never checkpoints more; the middle one mixes the op policy with full checkpointing.
    assert [sum(p != "none" for p in plan) for plan in plans] == sorted(
        (sum(p != "none" for p in plan) for plan in plans), reverse=True
    )
    assert {"op", "full"} <= set(plans[1])
    module = _model()
    report = apply_activation_checkpointing(
        _blocks(module),
        mode="auto",
        budget=0.5,
        device_memory=2 * predicted_peak(saved, saved),
        measure_fn=lambda: module.training_step(BATCH, 0),
    )
    assert report.budget_bytes == predicted_peak(saved, saved) and report.checkpointed == 0


def test_plan_takes_the_cheapest_policy_and_leaves_the_last_block_alone():
    saved, inputs, op = [100] * 4, [10] * 4, [60] * 4
    assert predicted_peak(saved, saved) == 400 and predicted_peak(saved, inputs) == 130
    assert plan_for_budget(saved, inputs, 400, op) == (["none"] * 4, 400)
    # Selective op on blocks 0-1 is enough for 330: it costs no matmul recomputation.
    assert plan_for_budget(saved, inputs, 330, op) == (["op", "op", "none", "none"], 320)
    assert plan_for_budget(saved, inputs, 280, op) == (["op", "op", "op", "none"], 280)
    # Below what op everywhere gives: blocks are moved to full checkpointing, earliest (longest-held) first.
    assert plan_for_budget(saved, inputs, 240, op) == (["full", "op", "op", "none"], 230)
    assert plan_for_budget(saved, inputs, 130, op) == (["full", "full", "full", "none"], 130)
    assert plan_for_budget(saved, inputs, 240) == (["full", "full", "none", "none"], 220)


def test_the_applied_mode_is_logged_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_llm.parallel.activation_checkpointing"):
        apply_activation_checkpointing(_blocks(_model()), mode="selective")
        apply_activation_checkpointing(_blocks(_model()), mode="none")
    assert caplog.messages == ["Applied activation checkpointing (selective op) to 4 of 4 blocks"]


def test_bad_settings_are_refused_before_anything_is_wrapped():
    module = _model()
    blocks = _blocks(module)
    measure = lambda: module.training_step(BATCH, 0)  # noqa: E731
    cases = [
        (
            dict(mode="sometimes"),
            ValueError,
            r"activation_checkpointing='sometimes' is not a mode; choose one of \('none', 'full', 'selective', 'auto'\)",
        ),
        (
            dict(mode="selective", selective="attention"),
            ValueError,
            r"selective='attention' is not a policy; choose one of \('op', 'layer'\)",
        ),
        (
            dict(mode="selective", selective="layer", every_n_layers=0),
            ValueError,
            "every_n_layers=0 must be an integer of at least 1",
        ),
        (dict(mode="auto", budget=1 << 20), ValueError, "'auto' needs measure_fn"),
        (dict(mode="auto", measure_fn=measure), TypeError, "budget=None must be bytes"),
        (
            dict(mode="auto", budget=1.5e9, measure_fn=measure),
            ValueError,
            r"fraction of device memory and must lie in \(0, 1\]; pass bytes as an int \(e.g. budget=1500000000\)",
        ),
        (dict(mode="auto", budget=-5, measure_fn=measure), ValueError, "budget=-5 bytes must be positive"),
        (dict(mode="full", block_indices=[0]), ValueError, "block_indices has 1 entries for 4 blocks"),
        (
            dict(mode="auto", budget=1000, measure_fn=measure),
            ValueError,
            r"budget 0.0 MiB is below what full checkpointing of every block keeps at its peak "
            r"\(1.5 MiB; without checkpointing 5.3 MiB\)",
        ),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            apply_activation_checkpointing(blocks, **kwargs)
    assert all("forward" not in vars(b) for b in blocks), "a refused call must leave the blocks untouched"
    with pytest.raises(ValueError, match="got no blocks"):
        apply_activation_checkpointing([], mode="full")
    apply_activation_checkpointing(blocks, mode="full")
    with pytest.raises(RuntimeError, match="TransformerBlock is already activation-checkpointed"):
        apply_activation_checkpointing(blocks, mode="full")


def test_config_options_are_validated_when_the_strategy_is_built():
    assert ACOptions.from_dict("auto", {"budget": 0.5}).budget == 0.5
    with pytest.raises(ValueError, match=r"Unknown activation_checkpointing_options \['budgett'\]"):
        ACOptions.from_dict("auto", {"budgett": 3})
    with pytest.raises(ValueError, match=r"needs activation_checkpointing_options=\{'budget'"):
        ACOptions.from_dict("auto", {})
    with pytest.raises(TypeError, match="budget='2GB' must be bytes"):
        ACOptions.from_dict("auto", {"budget": "2GB"})
    assert resolve_budget(0.5, device_memory=1000) == 500 and resolve_budget(4096, device_memory=None) == 4096
    with pytest.raises(ValueError, match="pass device_memory"):
        resolve_budget(0.5, device_memory=None)


# -- composition with FSDP2 (ZeRO-3) and tensor parallelism, layouts built by hand with raw torch --

_TP_PLAN = {
    **{f"attention.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
    **{f"feed_forward.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
    "attention.o_proj": RowwiseParallel(),
    "feed_forward.down_proj": RowwiseParallel(),
}


def _parallel_runs(layout: str) -> dict:
    """Every mode under ``layout`` ("dp2-zero3" or "tp2") on this rank: loss, full gradients, policies."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, results = dist.get_rank(), {}
    # Data parallel: each rank takes half the batch; FSDP2 averages gradients, the loss is averaged here.
    batch = BATCH[2 * rank : 2 * rank + 2] if layout == "dp2-zero3" else BATCH
    for label in ("none", *MODES):
        module = _model()
        blocks = _blocks(module)
        if layout == "tp2":
            for block in blocks:
                parallelize_module(block, mesh, _TP_PLAN)
        report = apply_activation_checkpointing(
            blocks, **(_options(label, module, batch) if label != "none" else {"mode": "none"})
        )
        if layout == "dp2-zero3":
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(module.model, mesh=mesh)
        loss = module.training_step(batch, 0)
        with _OpCounter(lambda op: "all_reduce" in str(op)) as collectives:
            loss.backward()
        grads = {n: _full(p.grad) for n, p in module.named_parameters()}
        if layout == "dp2-zero3":
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        results[label] = (loss.detach(), grads, report.policies, collectives.ops)
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp2-zero3", "tp2"])
def test_every_mode_composes_with_fsdp2_and_tensor_parallel(layout):
    ranks = run_distributed(_parallel_runs, 2, layout, timeout=240)
    want = _reference("reference")
    for rank, results in enumerate(ranks):
        for label, (loss, grads, _, _) in results.items():
            _assert_same((loss, grads), want, f"{layout} rank {rank} {label}")
    auto = ranks[0]["auto"][2]
    assert auto == ranks[1]["auto"][2] and sum(p != "none" for p in auto) > 0
    if layout == "tp2":  # the op policy keeps the row-parallel all-reduce outputs; full recomputes them
        collectives = {label: result[3] for label, result in ranks[0].items()}
        assert collectives["op"] == collectives["none"] < collectives["full"]
