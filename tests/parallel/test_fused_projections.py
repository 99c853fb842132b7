"""Fused projections and Conv1D under tensor parallelism: the regrouping, exactness in float64, real splitting.

The zoo (tests/zoo) trains these models under every layout in fp32; here the same layouts run in float64,
where a correct split agrees with one process to rounding (1e-12) and any mix-up of q/k/v between ranks
would show at full size, and the per-rank bytes of the attention weights are measured.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.parallel.tp.fused import fused_sizes, parse_fused, qkv_style, regroup_exchange
from lightning_llm.parallel.tp.plan import resolve_plan
from lightning_llm.testing import run_distributed
from tests.parallel._tp_models import HF_SOURCES

FUSED_MODELS = ["gpt2", "litgpt_llama", "litgpt_pythia", "phi3"]


@pytest.mark.parametrize(
    "sizes, tp", [((32, 16, 16), 2), ((8, 8, 8), 2), ((12, 4, 4), 4), ((6, 6), 3), ((64, 8, 8), 4)]
)
def test_exchange_gives_each_rank_its_share_of_every_part(sizes, tp):
    """Simulate the all-to-all on every rank with a brute-force oracle: rank s must end with [q_s | k_s | v_s]."""
    total = sum(sizes)
    columns = torch.arange(total)
    held = columns.chunk(tp)  # rank r's contiguous colwise shard
    plans = [regroup_exchange(sizes, tp, r) for r in range(tp)]
    for s in range(tp):
        received = []
        for r in range(tp):
            send, input_splits, _ = plans[r]
            start = sum(input_splits[:s])
            received.append(held[r][send][start : start + input_splits[s]])
        assert [len(x) for x in received] == plans[s][2]
        wanted, offset = [], 0
        for size in sizes:
            wanted.append(torch.arange(offset, offset + size).chunk(tp)[s])
            offset += size
        assert torch.equal(torch.cat(received), torch.cat(wanted))


def test_fused_style_strings():
    assert parse_fused("fused_colwise:2") == 2 and parse_fused("fused_colwise:32,16,16") == (32, 16, 16)
    assert parse_fused("colwise") is None
    assert fused_sizes("fused_colwise:2", 128) == (64, 64)
    with pytest.raises(ValueError, match="add up to 60, but the layer has 64"):
        fused_sizes("fused_colwise:30,15,15", 64)
    with pytest.raises(ValueError, match="malformed"):
        parse_fused("fused_colwise:q,k,v")


def test_qkv_sizes_come_from_the_head_counts_and_are_checked():
    from tests.zoo._models import ZooLM

    litgpt = ZooLM("litgpt_llama").model  # n_head 4, n_query_groups 2, head_size 8: q 32, k 16, v 16
    assert qkv_style(litgpt.transformer.h[0].attn, 64, "attn.qkv") == "fused_colwise:32,16,16"
    with pytest.raises(ValueError, match="fused_colwise:Q,K,V"):
        qkv_style(litgpt.transformer.h[0].attn, 60, "attn.qkv")


def test_known_fused_layouts_are_planned_and_hf_gathered_plans_become_splits():
    from tests.zoo._models import ZooLM

    gpt2 = ZooLM("gpt2")
    plan, source, *_ = resolve_plan(gpt2, blocks_name="model.transformer.h", blocks=gpt2.model.transformer.h)
    assert source == "inferred"
    assert plan["model.transformer.h.*.attn.c_attn"] == "fused_colwise:32,32,32"
    assert (
        plan["model.transformer.h.*.attn.c_proj"] == "rowwise" and plan["model.transformer.h.*.mlp.c_fc"] == "colwise"
    )
    phi3 = ZooLM("phi3")  # HF plan: qkv_proj / gate_up_proj gathered, o_proj / down_proj rowwise_split_input
    plan, source, *_ = resolve_plan(phi3, blocks_name="model.model.layers", blocks=phi3.model.model.layers)
    assert source in HF_SOURCES
    assert plan["model.model.layers.*.self_attn.qkv_proj"] == "fused_colwise:32,16,16"
    assert plan["model.model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.model.layers.*.mlp.gate_up_proj"] == "fused_colwise:2"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"


def test_unknown_fused_projection_is_refused_with_the_styles_that_fix_it():
    from torch import nn

    from lightning_llm.parallel.tp.plan import infer_plan

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wqkv, self.wo = nn.Linear(16, 48), nn.Linear(16, 16)

    blocks = nn.ModuleList([Attention(), Attention()])
    with pytest.raises(ValueError, match="'fused_qkv'.*'fused_colwise:2'.*'colwise'"):
        infer_plan(nn.ModuleDict({"layers": blocks}), "layers", blocks)


def _logits(model, batch):
    output = model(batch)
    return output if isinstance(output, torch.Tensor) else output.logits


def _fp64_ranks(models: list[str]) -> dict | None:
    """On each rank: float64 one-step gradients under tp2 and tp2+SP vs one process, attention bytes, full state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize
    from tests.zoo._harness import tokens
    from tests.zoo._models import ZooLM

    torch.set_default_dtype(torch.float64)
    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    batch = tokens()[:4]
    results = {}
    for name in models:
        for sp in (False, True):
            reference = ZooLM(name)
            module = ZooLM(name)
            module.load_state_dict(reference.state_dict())
            ref_loss = reference.training_step(batch, 0)
            ref_loss.backward()
            parallelize(module, dims, zero_stage=0, sequence_parallel=sp)
            loss = module.training_step(batch, 0)
            loss.backward()
            errors = {}
            for (key, param), (_, ref) in zip(module.named_parameters(), reference.named_parameters()):
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                errors[key] = ((grad - ref.grad).norm() / ref.grad.norm().clamp_min(1e-30)).item()
            attention = {n: p for n, p in module.named_parameters() if ".attn." in n or ".self_attn." in n}
            local = sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in attention.values()
            )
            whole = sum(p.numel() * p.element_size() for n, p in reference.named_parameters() if n in attention)
            state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
            unmodified = ZooLM(name)
            unmodified.load_state_dict(state)  # strict: the model's own names and shapes
            with torch.no_grad():
                logits_gap = _logits(unmodified.model, batch) - _logits(reference.model, batch)
            results[(name, sp)] = (
                abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                errors,
                local,
                whole,
                logits_gap.abs().max().item(),
            )
    results["hard_coded_width"] = _hard_coded_width_error(dims)
    results["stored_width"] = {scaled: _stored_width_run(dims, scaled) for scaled in (False, True)}
    return results if dist.get_rank() == 0 else None


class HardCodedWidthAttention(nn.Module):
    """nanoGPT's attention as written upstream: ``split(self.n_embd)`` and ``view(B, T, C)`` assume whole widths."""

    def __init__(self, n_embd: int = 16, n_head: int = 4):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _hard_coded_width_error(dims) -> str:
    """The message of the error nanoGPT's attention raises in its first forward under tp2, notes included."""
    import traceback

    from lightning_llm.parallel.parallelize import parallelize

    module = nn.Module()
    module.h = nn.ModuleList(nn.ModuleDict({"attn": HardCodedWidthAttention()}) for _ in range(2))
    parallelize(module, dims, zero_stage=0, tensor_parallel_plan={"h.*.attn.c_attn": "fused_qkv"})
    try:
        module.h[0].attn(torch.randn(2, 5, 16))
    except ValueError as error:
        return "".join(traceback.format_exception_only(error))
    return "no error"


class StoredWidthAttention(nn.Module):
    """XGLM's attention: the merged heads reshaped to ``self.embed_dim``; with ``scaled`` the scores are scaled by
    ``embed_dim ** -0.5`` too, so that this rank's width there would compute something else."""

    def __init__(self, embed_dim: int = 16, num_heads: int = 4, scaled: bool = False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.embed_dim, self.num_heads, self.head_dim, self.scaled = (
            embed_dim,
            num_heads,
            embed_dim // num_heads,
            scaled,
        )

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = (
            p(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scale = self.embed_dim**-0.5 if self.scaled else None
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, self.embed_dim))


def _stored_width_run(dims, scaled: bool):
    """Two blocks of :class:`StoredWidthAttention` under tp2 against one process (float64): the output and every
    gradient's relative error and the blocks' ``embed_dim`` after the first forward; or the error it raised."""
    import copy

    from torch.distributed.tensor import DTensor

    from lightning_llm.parallel.parallelize import parallelize

    torch.manual_seed(0)
    module = nn.Module()
    module.h = nn.ModuleList(nn.ModuleDict({"attn": StoredWidthAttention(scaled=scaled)}) for _ in range(2))
    reference = copy.deepcopy(module)
    plan = {f"h.*.attn.{n}_proj": "colwise" for n in "qkv"} | {"h.*.attn.out_proj": "rowwise"}
    parallelize(module, dims, zero_stage=0, tensor_parallel_plan=plan)
    x = torch.randn(2, 6, 16)

    def forward(model):
        y = x
        for block in model.h:
            y = block.attn(y)
        return y

    outputs, evaluated = [], []
    for model in (module, reference):
        try:
            with torch.no_grad():  # an evaluation first, as Lightning's sanity check runs before training
                evaluated.append(forward(model.eval()))
            y = forward(model.train())
        except RuntimeError as error:
            return f"{type(error).__name__}: {error}", [b.attn.embed_dim for b in module.h]
        y.pow(2).sum().backward()
        outputs.append(y)
    errors = {"output": ((outputs[0] - outputs[1]).norm() / outputs[1].norm()).item()}
    errors["evaluation output"] = ((evaluated[0] - evaluated[1]).norm() / evaluated[1].norm()).item()
    for (key, param), (_, ref) in zip(module.named_parameters(), reference.named_parameters()):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        # A key bias's true gradient is zero (softmax is shift-invariant), so its difference is measured absolutely.
        scale = 1.0 if key.endswith("k_proj.bias") else ref.grad.norm()
        errors[key] = ((grad - ref.grad).norm() / scale).item()
    return errors, [b.attn.embed_dim for b in module.h]


@pytest.fixture(scope="module")
def fp64_results():
    return run_distributed(_fp64_ranks, 2, FUSED_MODELS, timeout=240)[0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("name", FUSED_MODELS)
def test_fused_and_conv1d_layers_are_exact_in_float64(fp64_results, name, sp):
    loss_error, errors, _, _, _ = fp64_results[(name, sp)]
    assert loss_error < 1e-12
    for key, error in errors.items():
        # litgpt's RMSNorm computes in float32 whatever the input dtype (x.float()), so the gradient of its weight,
        # a sum over the sequence that SP splits across ranks, carries float32 rounding (measured 1.3e-7).
        rtol = (
            1e-6 if sp and name == "litgpt_llama" and key.rsplit(".", 2)[-2] in ("norm_1", "norm_2", "ln_f") else 1e-10
        )
        assert error < rtol, f"{name} sp={sp}: gradient of {key} off by {error:.1e}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "litgpt_llama", "litgpt_pythia", "phi3"])
def test_attention_is_really_split(fp64_results, name):
    """Each tp rank holds half of the attention weights (the fused QKV included), not a gathered copy."""
    _, _, local, whole, _ = fp64_results[(name, False)]
    biases_replicated = {"gpt2": 2 * 32 * 8, "litgpt_pythia": 2 * 32 * 8}  # row-split c_proj/proj biases stay whole
    assert local == (whole + biases_replicated.get(name, 0)) // 2


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_width_hard_coded_in_the_forward_is_explained_naming_the_module(fp64_results):
    message = fp64_results["hard_coded_width"]
    assert message.startswith("ValueError: not enough values to unpack (expected 3, got 2)")  # the model's own error
    assert "first forward of 'h.0.attn' (HardCodedWidthAttention) under tensor_parallel_size=2" in message
    assert "c_attn produces 24 of 48, c_proj reads 8 of 16 features" in message  # checked by hand: 3*16/2, 16/2
    assert "n_head=2" in message and "still holding a whole width: n_embd=16." in message


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stored_whole_width_the_forward_fails_on_becomes_this_ranks_width(fp64_results):
    # XGLM's reshape to self.embed_dim: 16 whole, 8 per rank (4 heads over tp=2, head_dim 4), in both blocks.
    errors, widths = fp64_results["stored_width"][False]
    assert widths == [8, 8]
    assert max(errors.values()) < 1e-12, errors
    # The same width also scaling the scores: per rank it runs but computes something else, so it stays whole and
    # the forward's own shape error stops the run (explained).
    error, widths = fp64_results["stored_width"][True]
    assert widths == [16, 16]
    assert "shape '[2, 6, 16]' is invalid" in error, error


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", FUSED_MODELS)
def test_checkpoint_state_keeps_the_models_own_layout(fp64_results, name):
    """The full state dict of the tp2 model loads strictly into the unmodified model and gives its logits."""
    assert fp64_results[(name, False)][4] < 1e-12


def _zoo_float64(layouts: list[str], models: list[str]):
    from tests.zoo._harness import train_zoo

    torch.set_default_dtype(torch.float64)
    return train_zoo(layouts, models)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gpt2_zoo_cell_is_exact_in_float64():
    """The oracle behind the zoo's looser fp32 tolerance for GPT-2: the same 4 Adam steps under tp2, in float64."""
    from tests.zoo._harness import train

    torch.set_default_dtype(torch.float64)
    try:
        ref_losses, ref_params, *_ = train("gpt2")
    finally:
        torch.set_default_dtype(torch.float32)
    result = run_distributed(_zoo_float64, 2, ["tp2"], ["gpt2"], timeout=240)[0]["tp2"]["gpt2"]
    assert not isinstance(result, str), result
    losses, params, differing, *_ = result
    assert not differing
    assert next(iter(params.values())).dtype == torch.float64
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=0)
    for name, ref in ref_params.items():
        assert ((params[name] - ref).norm() / ref.norm()).item() < 1e-12, name


class _GroupedQKVAttention(torch.nn.Module):
    """A user attention whose fused projection is grouped per KV head: [q of group 0 | k0 | v0 | q of group 1 | ...]
    (InternLM's and Megatron's layout). Its rows are contiguous per KV group, so a plain column split hands
    each tp rank whole groups; the head counts are module attributes, divided by tp."""

    def __init__(self, dim: int = 32, num_heads: int = 4, num_key_value_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = num_heads, num_key_value_heads, dim // num_heads
        rep = num_heads // num_key_value_heads
        self.wqkv = torch.nn.Linear(dim, num_key_value_heads * (rep + 2) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        rep = self.num_heads // self.num_key_value_heads
        groups = self.wqkv(x).view(b, t, self.num_key_value_heads, rep + 2, self.head_dim)
        q = groups[..., :rep, :].reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (groups[..., i, :].transpose(1, 2) for i in (rep, rep + 1))
        k, v = (z.repeat_interleave(rep, dim=1) for z in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class _GroupedQKVModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": _GroupedQKVAttention()}) for _ in range(2))
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer["attn"](x)
        return self.head(x)


def _grouped_qkv_ranks() -> dict | None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    torch.set_default_dtype(torch.float64)
    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    reference, model = _GroupedQKVModel(), _GroupedQKVModel()
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plan = {"layers.*.attn.wqkv": "colwise", "layers.*.attn.wo": "rowwise"}
    parallelize(model, dims, zero_stage=0, tensor_parallel_plan=plan)
    losses = []
    for m in (reference, model):
        loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    errors = {}
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        errors[name] = ((grad - ref.grad).norm() / ref.grad.norm()).item()
    local_heads = model.layers[0]["attn"].num_heads, model.layers[0]["attn"].num_key_value_heads
    return (losses, errors, local_heads) if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_qkv_grouped_per_kv_head_is_a_plain_column_split():
    (ref_loss, loss), errors, local_heads = run_distributed(_grouped_qkv_ranks, 2, timeout=240)[0]
    assert abs(loss - ref_loss) / ref_loss < 1e-12
    assert local_heads == (2, 1)  # each rank computes its own KV group's heads
    for name, error in errors.items():
        assert error < 1e-10, f"gradient of {name} off by {error:.1e}"
