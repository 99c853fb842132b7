"""Parallelism as plain functions of (module, mesh, options): mesh, TP/SP, pipeline stages, ZeRO via FSDP2,
activation checkpointing and the global gradient norm. They work outside Lightning; the strategies call them."""
