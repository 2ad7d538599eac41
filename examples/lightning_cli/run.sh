#!/usr/bin/env bash
# LightningCLI: a strategy class and its init args on the command line (main.py; lp_ddp with ZeRO-3), and by class_path in a
# YAML config, from a script that never imports lightning_parallel (own_module.py, config.yaml).
set -euo pipefail
PYTHON=${PYTHON:-python}
HERE="$(cd "$(dirname "$0")" && pwd)"
COMMON="--trainer.accelerator cpu --trainer.devices 2 --trainer.max_steps 10 --trainer.limit_val_batches 2
        --trainer.enable_progress_bar false --trainer.default_root_dir ${OUT:-outputs}/lightning_cli
        --model.n_layer 1 --model.n_embd 32 --data.max_chars 100000"

$PYTHON "$HERE/main.py" fit $COMMON \
  --trainer.strategy lightning_parallel.DDPStrategy --trainer.strategy.bucket_cap_mb 5 \
  --trainer.strategy.zero_stage 3

# the tensor-parallel strategy and its size
$PYTHON "$HERE/main.py" fit $COMMON \
  --trainer.strategy lightning_parallel.TensorParallelStrategy --trainer.strategy.tensor_parallel_size 2

# class_path in a YAML config; own_module.py does not import lightning_parallel
$PYTHON "$HERE/own_module.py" fit --config "$HERE/config.yaml" --trainer.default_root_dir ${OUT:-outputs}/lightning_cli
