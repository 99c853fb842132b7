"""GradNormMonitor reports the single-process gradient norm under every parallel layout."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_llm.callbacks import GradNormMonitor
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import Llama, LlamaConfig
from lightning_llm.parallel.grad_norm import total_grad_norm
from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import requires_deepspeed
from tests.strategies._parity import data, make_model

pytestmark = pytest.mark.distributed


def _first_norms(strategy="auto", devices=1, dp=1, arch="hf_gpt2", clip=None):
    monitor = GradNormMonitor(per_block=True, per_param_group=True)
    model = make_model(arch, layers=4)
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=1,
        log_every_n_steps=1,
        callbacks=[monitor],
        limit_val_batches=0,
        gradient_clip_val=clip,
    )
    trainer.fit(model, data(8 // dp))
    metrics = trainer.callback_metrics
    return {k: metrics[k].item() for k in metrics if k.startswith("grad_norm/")}


class _TorchNorms(L.Callback):
    """The oracle: torch's get_total_norm over the plain gradients of one process's first backward."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step:
            return

        def norm(params):
            return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).item()

        self.norms = {"grad_norm/total": norm(pl_module.parameters())}
        _, blocks = find_blocks(pl_module)  # which parameters make up block i; the norm is torch's
        self.norms |= {f"grad_norm/block_{i}": norm(b.parameters()) for i, b in enumerate(blocks)}
        self.norms |= {f"grad_norm/group_{i}": norm(g["params"]) for i, g in enumerate(optimizer.param_groups)}


def _torch_norms(arch):
    oracle = _TorchNorms()
    trainer = cpu_trainer(
        devices=1,
        max_steps=1,
        callbacks=[oracle],
        limit_val_batches=0,
    )
    trainer.fit(make_model(arch, layers=4), data(8))
    return oracle.norms


def _layouts(world_size):
    from lightning_llm.strategies import LLMParallelStrategy

    return {
        "dp2 (ddp)": _first_norms("ddp", world_size, dp=2),
        "dp2 zero3": _first_norms(LLMParallelStrategy(zero_stage=3), world_size, dp=2),
        "tp2": _first_norms(LLMParallelStrategy(tensor_parallel_size=2), world_size, arch="hf_llama"),
        "pp2 (tied embedding on both stages)": _first_norms(
            LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), world_size
        ),
    }


def test_norm_equals_single_process_under_every_layout():
    results = run_distributed(_layouts, 2, 2, timeout=300)[0]
    for label, norms in results.items():
        arch = "hf_llama" if label == "tp2" else "hf_gpt2"
        want = _torch_norms(arch)
        assert norms.keys() == want.keys(), label
        for key, value in want.items():
            assert norms[key] == pytest.approx(value, rel=1e-5), f"{label} {key}"
        blocks = sum(v**2 for k, v in want.items() if "block_" in k)
        assert blocks < want["grad_norm/total"] ** 2
        # One optimizer group: its norm is the total (a weight tied across pipeline stages counts once).
        assert norms["grad_norm/group_0"] == pytest.approx(want["grad_norm/total"], rel=1e-5), label


def test_clipped_flag_and_arguments():
    norms = _first_norms(arch="reference", clip=1e-3)
    assert norms["grad_norm/was_clipped"] == 1.0
    # The reference recipe's two groups (matrices with weight decay, vectors without) make up the total.
    groups = norms["grad_norm/group_0"] ** 2 + norms["grad_norm/group_1"] ** 2
    assert groups == pytest.approx(norms["grad_norm/total"] ** 2, rel=1e-5) and norms["grad_norm/group_1"] > 0
    assert _first_norms(arch="reference", clip=1e3)["grad_norm/was_clipped"] == 0.0
    with pytest.raises(ValueError, match="norm_type=0"):
        GradNormMonitor(norm_type=0)


def _deepspeed_norm(world_size):
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    return _first_norms(LLMDeepSpeedStrategy(zero_stage=2), world_size, dp=2, arch="reference", clip=1e3)


@requires_deepspeed
def test_norm_under_deepspeed_zero2_equals_single_process():
    norms = run_distributed(_deepspeed_norm, 2, 2, timeout=240)[0]
    want = _first_norms(arch="reference", clip=1e3)
    assert norms["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-5)


# The norm function itself, on the reference model parallelized by hand with raw torch APIs.
NORM_TYPES = (2.0, float("inf"))


def _tiny_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", n_layers=2))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))


def _backward(model, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()


def _norms(parameters, group=None) -> list[float]:
    parameters = list(parameters)
    return [total_grad_norm(parameters, norm_type, pipeline_group=group).item() for norm_type in NORM_TYPES]


def _fsdp2_norms(rank: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = _tiny_llama(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _backward(model, _tokens()[2 * rank : 2 * rank + 2])  # half the batch each; FSDP averages the gradients
    return _norms(model.parameters())


def _tp2_norms() -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, mesh = _tiny_llama(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {f"attention.{n}_proj": ColwiseParallel() for n in "qkv"} | {"attention.o_proj": RowwiseParallel()}
    plan |= {
        "feed_forward.gate_proj": ColwiseParallel(),
        "feed_forward.up_proj": ColwiseParallel(),
        "feed_forward.down_proj": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, mesh, plan)  # the norms and embeddings stay plain, replicated tensors
    _backward(model, _tokens())
    return _norms(model.parameters())


def _pp2_norms(rank: int) -> list[float]:
    """Two stages by hand: rank 0 holds the embedding and block 0, rank 1 block 1 and the head."""
    model, tokens = _tiny_llama(), _tokens()
    inputs, seq = tokens[:, :-1], tokens.shape[1] - 1
    from lightning_llm.models.llama import rotary_tables

    cos, sin = rotary_tables(seq, model.config.head_dim, model.config.rope_theta, torch.device("cpu"))
    hidden = torch.empty(inputs.shape[0], seq, model.config.dim)
    if rank == 0:
        out = model.layers[0](model.tok_embeddings(inputs), cos, sin)
        dist.send(out.detach(), dst=1)
        dist.recv(hidden, src=1)  # the gradient of the stage output
        out.backward(hidden)
        held = [*model.tok_embeddings.parameters(), *model.layers[0].parameters()]
    else:
        dist.recv(hidden, src=0)
        hidden.requires_grad_(True)
        logits = model.output(model.norm(model.layers[1](hidden, cos, sin)))
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        dist.send(hidden.grad, dst=0)
        held = [*model.layers[1].parameters(), *model.norm.parameters(), *model.output.parameters()]
    return _norms(held, group=dist.group.WORLD)


def _sharded_layouts(world_size: int) -> dict[str, list[float]]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return {"fsdp2 dp2": _fsdp2_norms(rank), "tp2": _tp2_norms(), "pp2": _pp2_norms(rank)}


def test_norm_function_under_fsdp2_tp2_and_two_pipeline_stages():
    model = _tiny_llama()
    _backward(model, _tokens())
    want = _norms(model.parameters())
    for rank_results in run_distributed(_sharded_layouts, 2, 2, timeout=180):
        for layout, norms in rank_results.items():
            for norm_type, got, expected in zip(NORM_TYPES, norms, want):
                assert got == pytest.approx(expected, rel=1e-5), f"{layout} norm_type={norm_type}"
