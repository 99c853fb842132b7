"""The automatic tensor-parallel plan, and the errors for models it cannot split. No processes needed."""

import ast

import pytest
import torch
from torch import nn

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import Llama, LlamaConfig
from lightning_llm.parallel.parallelize import plan_tensor_parallel
from lightning_llm.parallel.tp.apply import (
    divide_head_counts,
    hf_plan,
    infer_plan,
    validate_plan,
)
from lightning_llm.testing.models import HFCausalLM, UserLM
from tests.parallel._tp_models import HF_SOURCES


def _plan(module, tp=2, user_plan=None):
    name, blocks = find_blocks(module)
    return plan_tensor_parallel(module, tp=tp, blocks_name=name, blocks=blocks, user_plan=user_plan)


def test_reference_model_plan_is_inferred_from_names():
    plan, source = _plan(Llama(LlamaConfig.from_name("tiny")))
    assert source == "inferred"
    assert plan == {
        "layers.*.attention.q_proj": "colwise",
        "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise",
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.feed_forward.gate_proj": "colwise",
        "layers.*.feed_forward.up_proj": "colwise",
        "layers.*.feed_forward.down_proj": "rowwise",
        "tok_embeddings": "embedding",
        "output": "colwise_gather",
    }


def test_user_model_plan_uses_its_own_names():
    plan, _ = _plan(UserLM())
    assert plan["blocks.*.attn.query"] == plan["blocks.*.attn.value"] == plan["blocks.*.fc_in"] == "colwise"
    assert plan["blocks.*.attn.proj"] == plan["blocks.*.fc_out"] == "rowwise"
    assert plan["embed"] == plan["pos"] == "embedding" and plan["head"] == "colwise_gather"


def test_unnamed_linears_are_classified_by_shape():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.widen, self.narrow = nn.Linear(16, 64), nn.Linear(64, 16)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList(Block() for _ in range(3))

    plan = infer_plan(Net(), "stack", Net().stack)
    assert plan == {"stack.*.widen": "colwise", "stack.*.narrow": "rowwise"}


def test_hugging_face_plan_is_found_and_translated():
    module = HFCausalLM("llama")
    plan, source = _plan(module)
    assert source in HF_SOURCES
    assert plan["model.lm_head"] == "colwise_gather"
    assert plan["model.model.embed_tokens"] == "embedding"
    assert plan["model.model.layers.*.self_attn.o_proj"] == "rowwise"


def test_plans_merge_per_module_strategy_over_module_hook_over_hugging_face():
    module = HFCausalLM("llama")
    module.tensor_parallel_plan = lambda: {
        "model.model.layers.*.mlp.up_proj": "colwise_gather",
        "model.model.layers.*.mlp.down_proj": "rowwise_split_input",
    }
    plan, source = _plan(module, user_plan={"model.model.layers.*.mlp.down_proj": "rowwise"})
    assert source in tuple(f"strategy + module + {s}" for s in HF_SOURCES)
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"  # the user's, over the hook's and HF's
    assert plan["model.model.layers.*.mlp.up_proj"] == "colwise_gather"  # the hook's, over HF's
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"  # HF's, named by no one else


def test_inference_fills_what_a_partial_hugging_face_plan_leaves_out():
    module = HFCausalLM("llama")
    module.model._tp_plan = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"}
    plan, source = _plan(module)
    assert source == "hugging face + inferred"
    assert plan["model.lm_head"] == "colwise_gather" and plan["model.model.embed_tokens"] == "embedding"
    assert plan["model.model.layers.*.self_attn.q_proj"] == plan["model.model.layers.*.mlp.up_proj"] == "colwise"
    assert plan["model.model.layers.*.self_attn.o_proj"] == plan["model.model.layers.*.mlp.down_proj"] == "rowwise"


def test_a_part_left_whole_is_refused_unless_replicated_on_purpose():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o, self.mix = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)

    module = nn.Module()
    module.blocks = nn.ModuleList(Block() for _ in range(2))
    with pytest.raises(ValueError, match=r"would leave 'blocks.\*.mix' \(20% of its block's parameters\) whole"):
        _plan(module)
    name, blocks = find_blocks(module)
    plan, source = plan_tensor_parallel(
        module, tp=2, blocks_name=name, blocks=blocks, user_plan=None, replicate=["blocks.*.mix"]
    )
    assert plan == {"blocks.*.mix": "replicate", "blocks.*.q": "colwise", "blocks.*.o": "rowwise"}
    assert source == "strategy + inferred"


def test_fused_projection_is_refused_with_the_fixing_plan_entry():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"attn": Attn()}) for _ in range(2))

    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.attn\.qkv' looks like a fused projection.*'layers\.\*\.attn\.qkv': STYLE.*'fused_qkv'",
    ):
        infer_plan(Net(), "layers", Net().layers)


def test_ambiguous_square_linear_is_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(2))

    with pytest.raises(ValueError, match=r"Cannot tell whether 'layers\.0\.0' \(8 -> 8\)"):
        infer_plan(Net(), "layers", Net().layers)


def test_nothing_to_shard_is_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.LayerNorm(4) for _ in range(2))

    with pytest.raises(ValueError, match=r"contain no nn.Linear \(or Conv1D\) layer to shard"):
        infer_plan(Net(), "layers", Net().layers)


def test_plan_validation_names_the_problem():
    model = Llama(LlamaConfig.from_name("tiny"))
    with pytest.raises(ValueError, match=r"Unknown tensor-parallel style 'diagonal'"):
        validate_plan(model, {"layers.*.attention.q_proj": "diagonal"}, 2)
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*\.attn\.wq' matches no module"):
        validate_plan(model, {"layers.*.attn.wq": "colwise"}, 2)
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.attention\.k_proj' \(colwise\) has out_features=32, not divisible by tensor_parallel_size=3",
    ):
        validate_plan(model, {"layers.*.attention.k_proj": "colwise"}, 3)


def test_head_counts_are_divided_and_checked():
    module = UserLM(num_heads=4)
    assert divide_head_counts(module.blocks, 2) == 2
    assert module.blocks[0].attn.num_heads == 2
    with pytest.raises(ValueError, match=r"attn\.num_heads=2 in block 0 is not divisible by tensor_parallel_size=4"):
        divide_head_counts(UserLM(num_heads=2).blocks, 4)


def _with_modules(*names: str) -> nn.Module:
    """A module tree holding a Linear at each dotted name (HF plans only keep entries naming a module)."""
    root = nn.Module()
    for name in names:
        parent = root
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(name.rsplit(".", 1)[-1], nn.Linear(2, 2))
    return root


def test_hf_plan_with_unknown_style_is_refused():
    module = _with_modules("layers.0.experts")
    module._tp_plan = {"layers.*.experts": "ep_router"}
    with pytest.raises(
        ValueError, match=r"'layers\.\*\.experts': 'ep_router' \(expert parallelism.*tensor_parallel_plan=\{\}"
    ):
        hf_plan(module)


def test_block_discovery_and_override():
    model = Llama(LlamaConfig.from_name("tiny", n_layers=3))
    assert find_blocks(model)[0] == "layers"
    assert find_blocks(HFCausalLM("gpt2"))[0] == "model.transformer.h"
    assert find_blocks(model, "layers")[1] is model.layers
    with pytest.raises(ValueError, match="blocks='layers.9' names no submodule"):
        find_blocks(model, "layers.9")
    with pytest.raises(ValueError, match="is a Linear, not a non-empty nn.ModuleList"):
        find_blocks(model, "output")
    with pytest.raises(ValueError, match=r"Linear holds parameters \['weight', 'bias'\] itself and no block"):
        find_blocks(nn.Linear(2, 2))


def test_user_plan_wins_over_an_hf_plan_we_refuse():
    module = nn.Module()
    module.inner = _with_modules("layers.0.self_attn.kv_a_proj_with_mqa")
    module.inner._tp_plan = {"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}
    module.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2))
    user = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
    user_with_mla = {**user, "inner.layers.*.self_attn.kv_a_proj_with_mqa": "replicate"}
    assert _plan(module, user_plan=user_with_mla) == (user_with_mla, "strategy")
    with pytest.raises(ValueError, match=r"'inner\.layers\.\*\.self_attn\.kv_a_proj_with_mqa': 'mla_kv_a_proj'"):
        _plan(module)


def test_every_hf_style_transformers_registers_is_mapped_or_refused():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from lightning_llm.parallel.tp.style_kinds import HF_REFUSED, HF_STYLES

    registered = (
        set(ALL_PARALLEL_STYLES.valid_keys())
        if hasattr(ALL_PARALLEL_STYLES, "valid_keys")
        else set(ALL_PARALLEL_STYLES)
    )
    assert registered, "transformers registers no TP style"
    assert registered <= set(HF_STYLES) | set(HF_REFUSED), sorted(registered - set(HF_STYLES) - set(HF_REFUSED))


def test_refused_hf_entry_names_a_plan_without_its_module():
    module = _with_modules(
        "layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.shared_experts", "layers.0.mlp.other"
    )
    module._tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.shared_experts": "all_reduce",
        "layers.*.mlp.other": "colwise",
        "layers.*.mlp.absent": "colwise",  # names no module of this model: dropped, not refused
    }
    with pytest.raises(ValueError) as info:
        hf_plan(module)
    message = str(info.value)
    assert "'layers.*.mlp.shared_experts': 'all_reduce'" in message and "absent" not in message
    suggested = ast.literal_eval(message.split("tensor_parallel_plan=", 1)[1].rstrip("."))
    assert suggested == {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}


def test_qwen3_per_head_norms_get_their_gradients_summed():
    from tests.parallel._tp_models import TinyHF

    plan, source = _plan(TinyHF("qwen3"))
    assert source in HF_SOURCES
    assert (
        plan["model.model.layers.*.self_attn.q_norm"]
        == plan["model.model.layers.*.self_attn.k_norm"]
        == "replicate_grad_sum"
    )
    assert "model.model.layers.*.input_layernorm" not in plan  # sees whole activations: nothing to sum


def test_per_head_norm_in_a_user_model_is_found_without_a_plan_entry():
    from lightning_llm.parallel.tp.model_plan import with_region_parameters

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o, self.q_norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.RMSNorm(4)

    block = nn.ModuleDict({"norm": nn.LayerNorm(16), "attn": Attn()})
    plan = with_region_parameters(
        {"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}, "blocks", nn.ModuleList([block])
    )
    assert plan["blocks.*.attn.q_norm"] == "replicate_grad_sum" and "blocks.*.norm" not in plan


def test_first_forward_stops_a_whole_parameter_module_on_sharded_heads():
    from lightning_llm.parallel.tp.coverage import verify_on_first_forward

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o, self.scale = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.o(self.scale(self.q(x)))

    attn = Attn()
    verify_on_first_forward(attn, {"q": "colwise", "o": "rowwise"}, label="layers.*.attn")
    with pytest.raises(
        RuntimeError,
        match=r"layers\.\*\.attn\.scale keeps whole parameters but runs on head-sharded.*'replicate_grad_sum'",
    ):
        attn(torch.randn(2, 8))
    pre_norm = Attn()
    pre_norm.forward = lambda x: pre_norm.o(pre_norm.q(pre_norm.scale(x)))
    verify_on_first_forward(pre_norm, {"q": "colwise", "o": "rowwise", "scale": "replicate_grad_sum"}, label="b")
    with pytest.raises(RuntimeError, match=r"b\.scale keeps whole parameters but runs on activations that are whole"):
        pre_norm(torch.randn(2, 8))


@pytest.mark.parametrize(
    "make, tp, match",
    [
        (
            lambda: HFCausalLM("llama", heads=4, kv_heads=2),
            4,
            r"num_key_value_heads=2 is not divisible by tensor_parallel_size=4",
        ),
        (
            lambda: HFCausalLM("llama", hidden=48, heads=3, kv_heads=3),
            2,
            r"num_attention_heads=3 is not divisible by tensor_parallel_size=2",
        ),
        (
            lambda: UserLM(width=48, num_heads=3),
            2,
            r"blocks\.0\.attn\.num_heads=3|attn\.num_heads=3 is not divisible by tensor_parallel_size=2",
        ),
        (
            lambda: Llama(LlamaConfig.from_name("tiny")),
            4,
            r"config\.n_kv_heads=2 is not divisible by tensor_parallel_size=4",
        ),
    ],
    ids=["hf-kv2-tp4", "hf-heads3-tp2", "user-heads3-tp2", "reference-kv2-tp4"],
)
def test_head_counts_are_checked_before_anything_changes(make, tp, match):
    with pytest.raises(ValueError, match=match):
        _plan(make(), tp=tp)


def test_shapes_decide_over_names_and_names_decide_square_layers():
    class FeedForward(nn.Module):  # Lightning's test model: w1 and w2 read the residual width, w3 writes it
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
            self.o = nn.Linear(32, 32)  # square: its name says row-wise

    module = nn.Module()
    module.layers = nn.ModuleList(FeedForward() for _ in range(2))
    plan, _ = _plan(module)
    assert plan == {
        "layers.*.w1": "colwise",
        "layers.*.w2": "colwise",
        "layers.*.w3": "rowwise",
        "layers.*.o": "rowwise",
    }


def test_the_refusal_prints_a_plan_that_works_once_its_one_missing_entry_is_filled():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(16, 48), nn.Linear(16, 16)
            self.n_head = 4  # fused_qkv reads the head count for the part sizes

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()
            self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    module = nn.Module()
    module.wte, module.h, module.lm_head = (
        nn.Embedding(32, 16),
        nn.ModuleList(Block() for _ in range(2)),
        nn.Linear(16, 32),
    )
    with pytest.raises(ValueError, match="would leave 'h.\\*.attn.c_attn'") as refused:
        _plan(module)
    printed = str(refused.value).split("the one missing entry is enough):\n", 1)[1]
    assert "'h.*.attn.c_attn': STYLE,  # <- the missing entry" in printed
    filled = ast.literal_eval(printed.replace("STYLE,  # <- the missing entry", "'fused_qkv',"))
    plan, _ = _plan(module, user_plan=filled)
    minimal, _ = _plan(module, user_plan={"h.*.attn.c_attn": "fused_qkv"})
    assert plan == minimal  # the printed plan is the whole plan: filled in, it changes nothing else
    assert plan["h.*.mlp.0"] == "colwise" and plan["h.*.attn.c_proj"] == "rowwise" and plan["wte"] == "embedding"


def test_a_long_printed_plan_is_cut_but_keeps_the_missing_entry():
    from lightning_llm.parallel.tp.coverage import _plan_so_far

    printed = _plan_so_far({f"layers.{i}.q": "colwise" for i in range(50)}, "layers.*.mix", limit=40)
    lines = printed.splitlines()
    assert lines[-3:] == ["    # ... 10 more", "    'layers.*.mix': STYLE,  # <- the missing entry", "}"]
    assert "'layers.39.q'" in printed and "'layers.40.q'" not in printed


def test_a_router_inside_a_gate_module_beside_the_experts_stays_whole():
    # HunYuan-MoE: mlp.gate.wg (dim -> experts) sits one level below the experts' sibling. Split column-wise it
    # would give each rank the scores of half the experts, and top-k over them trains silently wrong.
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 128, 32))
            self.down_proj = nn.Parameter(torch.zeros(4, 32, 64))

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.wg = nn.Linear(32, 4, bias=False)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = Gate(), Experts()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.mlp = nn.Linear(32, 64), nn.Linear(64, 32), Moe()

    module = nn.Module()
    module.layers = nn.ModuleList(Block() for _ in range(2))
    plan = infer_plan(module, "layers", module.layers)
    assert plan["layers.*.mlp.gate.wg"] == "replicate"
    assert plan["layers.*.mlp.experts"] == "experts" and plan["layers.*.up"] == "colwise"


def test_first_forward_stops_a_norm_over_all_heads_before_it_runs():
    # BitNet's attn_sub_norm: RMSNorm over all heads' outputs, between the split projections. On one rank's
    # half of the heads (emulated here by a q of half the width) it cannot run; the stop names the fix.
    from lightning_llm.parallel.tp.coverage import verify_on_first_forward

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o, self.sub_norm = nn.Linear(8, 4), nn.Linear(4, 8), nn.RMSNorm(8)

        def forward(self, x):
            return self.o(self.sub_norm(self.q(x)))

    attn = Attn()
    verify_on_first_forward(attn, {"q": "colwise", "o": "rowwise", "sub_norm": "replicate_grad_sum"}, "layers.3")
    with pytest.raises(RuntimeError, match=r"layers\.3\.sub_norm has 8-wide .* 4 columns.*tensor_parallel_replicate"):
        attn(torch.randn(2, 8))


def test_first_forward_stops_a_whole_layer_that_mixes_all_heads_before_it_runs():
    # Doge's dt_proj reads every value head to make one gate per head; on one rank's half it cannot run.
    from lightning_llm.parallel.tp.coverage import verify_on_first_forward

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.v, self.o, self.dt_proj = nn.Linear(8, 4), nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            v = self.v(x)
            return self.o(v * self.dt_proj(v).sum(-1, keepdim=True))

    attn = Attn()
    verify_on_first_forward(attn, {"v": "colwise", "o": "rowwise", "dt_proj": "replicate_grad_sum"}, "layers.0")
    with pytest.raises(RuntimeError, match=r"layers\.0\.dt_proj has 8-wide parameters but runs on this rank's 4"):
        attn(torch.randn(2, 8))


def test_an_attribute_holding_the_cut_widths_gets_this_ranks_widths():
    """PaLM keeps its cut as ``fused_dims`` and splits by it: under ``fused_colwise:32,*8,*8,128,128`` at tp=2 a rank
    holds 16 + 8 + 8 + 64 + 64 columns, so the four widths become (16, 8, 8, 128) (by hand); an attribute the parts
    do not add up to (or not made of ints) is left as it is."""
    from lightning_llm.parallel.tp.heads import localize_part_widths

    owner = nn.Module()
    owner.fused_dims, owner.other, owner.scales = (32, 8, 8, 256), [40, 264], (1.0, 2.0)
    owner.unrelated = (3, 5)
    changed = localize_part_widths(owner, (32, 8, 8, 128, 128), (False, True, True, False, False), tp=2)
    assert changed == ["fused_dims", "other"]
    assert owner.fused_dims == (16, 8, 8, 128) and owner.other == [24, 136]
    assert owner.scales == (1.0, 2.0) and owner.unrelated == (3, 5)
