#!/usr/bin/env bash
# Download the few small packages benchmarks/gpu_suite.sh needs beyond what a GPU cluster image carries, as wheels for
# Python 3.12 / x86-64 / manylinux, into one folder (default .whl) to carry to a machine with no network.
#
#   bash benchmarks/gpu_wheels.sh [FOLDER]
#
# An image with torch, Lightning, transformers, pytest, rich, tqdm, psutil and tokenizers lacks only these:
#   jsonargparse (+ docstring-parser, typeshed-client for its [signatures] extra)  LightningCLI and `lightning-llm`
#   torchao 0.17.0                                                                 fp8 training (built for torch 2.11)
# About 4.2 MiB in all. DeepSpeed (a large source build) and wandb (tens of MiB) are left out: the suite measures
# without them and says so in its report.
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" \
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 torchao==0.18.0
du -sh "$dest"
ls "$dest"
