"""bf16-mixed and fp8 under FSDP2 over gloo train like one process doing the same arithmetic.

bf16-mixed: LLMParallelStrategy maps it to FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (ZeRO 3 all-gathers bf16 parameters, ZeRO 0 replicates them; gradients are
reduced in fp32); the single process runs Lightning's own bf16-mixed (autocast). The two round at
different places (FSDP2 casts every parameter, norms included, to bf16; autocast only the matmul
inputs), so they agree to bf16 accuracy, not bitwise. Tolerance, derived: bf16 keeps 8 significant
bits, unit roundoff u = 2^-8 = 3.9e-3; a loss is a mean over 8 x 32 tokens of quantities each
rounded a few times, so per-step losses agree within ~u: we allow 1e-2 (2.5 u) over 5 steps. The
parameters are fp32 masters that move by lr * (gradient computed in bf16); after 5 steps their
relative difference is bounded by the update's share of the weight times its bf16 error, well under
u: we allow 2e-3 (measured: see the report printed by the test on failure). ZeRO-0 replicas must be
bitwise identical on both ranks.

fp8: the same Linear layers converted by torchao, FSDP2 ZeRO 3 all-gathering fp8 weights
(tensorwise scales from the global amax) vs torchao's conversion on a plain single-process model, in
fp32 otherwise. Tensorwise scaling takes each activation's scale from the amax of the whole local
batch, so a rank holding half the batch casts differently from one process holding all of it (a
1e-2 difference, as large as fp8 vs fp32). Here every rank therefore reads the same batches as the
single process: the mean of identical gradients is that gradient, and any difference comes from the
sharded fp8 path itself (weight scales, fp8 all-gather, reduce-scatter). The fp8 casts agree when
the scales do; what is left is summation order, held to fp32's 1e-5 over ``FP8_STEPS`` = 3 steps.
Not 5: a cast is a step function, so a last-bit difference in a tensor being cast occasionally moves
one element to the neighbouring fp8 value (e5m2 gradients: 2^-3 relative and more), and SGD at lr 0.5
carries that element's whole bin into the weight. On an AMX Xeon (whose fp32 kernels sum split shapes
in another order) dp2 x tp2 ZeRO 3 was within 4.8e-7 through step 3, then one such flip in step 4 put
layer 0's ``v_proj`` 4.2e-3 away (1.0e-2 and a 6.4e-5 loss after step 5). Every fp8 path runs in each
step, and what this guards against shows in the first (a scale over the wrong group: 5e-2).

gloo all-reduces, reduce-scatters and all-gathers bf16 tensors on CPU in torch 2.13 (checked first,
in the same processes); FSDP2 reduces in fp32 anyway (``reduce_dtype``).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_llm.data import LLMDataModule
from lightning_llm.data.sampler import ResumableDistributedSampler
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests._optional import HAS_TORCHAO
from tests.strategies._parity import assert_parity, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ARCH = "hf_llama"
STEPS = 5
BF16_LOSS_RTOL = 1e-3
BF16_PARAM_RTOL = 1e-2
FP8_RTOL = 1e-5
FP8_STEPS = 3
BF16_LAYOUTS = {"zero3": {"zero_stage": 3}, "zero0": {"zero_stage": 0}}


def _local_state(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone().float() for n, p in model.named_parameters()
    }


class SameOnEveryRank(LLMDataModule):
    """Every rank reads all batches (no data-parallel split), so one process can do exactly the same arithmetic."""

    def _sampler(self, dataset, shuffle):
        return ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=self.hparams.seed)


def _same_data() -> LLMDataModule:
    return SameOnEveryRank(num_tokens=20_000, seq_len=32, batch_size=4, seed=3)


def _train_keep_local(strategy, precision, datamodule=None, steps=STEPS):
    model = make_model(ARCH)
    result = train(
        ARCH, strategy, devices=2, dp=2, steps=steps, precision=precision, model=model, datamodule=datamodule
    )
    return result, _local_state(model)


def _mixed_precision_layouts():
    runs = {"gloo bf16": _gloo_bf16()}  # first: it opens the process group the Trainers then join
    for label, layout in BF16_LAYOUTS.items():
        runs[f"bf16 {label}"] = _train_keep_local(LLMParallelStrategy(**layout), "bf16-mixed")
    if HAS_TORCHAO:  # fp8 needs torchao, an optional extra
        runs["fp8 zero3"] = _train_keep_local(
            LLMParallelStrategy(zero_stage=3, fp8=True), "32-true", _same_data(), FP8_STEPS
        )
    return runs


def _fp8_single_process():
    from lightning_llm.parallel.float8 import apply_fp8

    model = make_model(ARCH)
    apply_fp8(model, blocks_name="model.model.layers")
    return train(ARCH, steps=FP8_STEPS, model=model, datamodule=_same_data())


def test_bf16_and_fp8_layouts_match_single_process():
    ranks = run_distributed(_mixed_precision_layouts, 2, timeout=540)
    _check_gloo_bf16(ranks)
    bf16_single = train(ARCH, steps=STEPS, precision="bf16-mixed")
    for label in BF16_LAYOUTS:
        result, _ = ranks[0][f"bf16 {label}"]
        assert_parity(result, bf16_single, f"bf16-mixed {label}", rtol=BF16_PARAM_RTOL, loss_rtol=BF16_LOSS_RTOL)
    replicas = [rank["bf16 zero0"][1] for rank in ranks]
    for name, tensor in replicas[0].items():
        assert torch.equal(tensor, replicas[1][name]), f"ZeRO-0 replica of {name} differs between ranks"
    if HAS_TORCHAO:
        assert_parity(ranks[0]["fp8 zero3"][0], _fp8_single_process(), "fp8 zero3 (fp8 all-gather)", rtol=FP8_RTOL)


def _gloo_bf16():
    dist.init_process_group("gloo")  # from run_distributed's environment; Lightning reuses it
    rank = dist.get_rank()
    summed = torch.tensor([1.0 + rank, 0.5], dtype=torch.bfloat16)
    dist.all_reduce(summed)
    scattered = torch.empty(2, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(scattered, torch.arange(4, dtype=torch.bfloat16) + rank)
    gathered = torch.empty(4, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), dtype=torch.bfloat16))
    return summed.tolist(), scattered.tolist(), gathered.tolist()


def _check_gloo_bf16(ranks):
    (summed, scattered0, gathered), (_, scattered1, _) = (rank["gloo bf16"] for rank in ranks)
    assert summed == [3.0, 1.0]  # 1 + 2, 0.5 + 0.5
    assert scattered0 == [1.0, 3.0] and scattered1 == [5.0, 7.0]  # (0+1, 1+2) and (2+3, 3+4)
    assert gathered == [0.0, 0.0, 1.0, 1.0]
