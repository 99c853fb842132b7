"""Tensor (+ sequence) parallelism, from the whole model's plan to its first forward.

- Planning the whole model (:mod:`.model_plan`): which style each module gets (:mod:`.plan`), what a plan's entries
  mean (:mod:`.style_kinds`: the style kinds, Hugging Face's style names, pattern matching), styles inferred by
  shape and name (:mod:`.infer`) and by the dataflow of a fake forward (:mod:`.traced_layouts`), attention
  variants (:mod:`.attention_variants`), PyTorch's ``nn.MultiheadAttention`` (:mod:`.multihead_attention`), the
  entries sequence parallelism adds (:mod:`.sequence_parallel_plan`), head counts (:mod:`.heads`) and what the
  plan leaves whole (:mod:`.coverage`).
- The styles (:mod:`.styles`): fused projections (:mod:`.fused`), MoE experts (:mod:`.experts`), fp8 layers
  (:mod:`.float8`).
- Applying it (:mod:`.apply`): what attention modules need once their heads are split (:mod:`.attention_heads`),
  gradients of parameters left whole inside split regions (:mod:`.coverage`), sequence-parallel boundaries
  around block parts (:mod:`.sequence_boundaries`), and the first forward's checks (:mod:`.split_outputs`,
  :mod:`.first_forward_parity`, :mod:`.first_forward_widths`).
"""
