#!/usr/bin/env bash
# lp-train under torchrun: torchrun creates the processes, Lightning detects them, lp-train's own
# launcher stays out of the way. Give every rank the same hydra.run.dir (ranks > 0 log to
# train_rank<r>.log there; rank 0 writes summary.json).
set -euo pipefail
TORCHRUN=${TORCHRUN:-torchrun}
RUN_DIR=${OUT:-outputs}/torchrun

# one machine, 2 processes (what the tests run)
$TORCHRUN --standalone --nproc-per-node=2 -m lightning_parallel.cli.train \
  trainer.devices=2 experiment=quick hydra.run.dir=$RUN_DIR

# two machines with 4 GPUs each: run on every node (NODE_RANK=0 on the first, 1 on the second),
# with MASTER_ADDR the first node's address and a shared file system for the output folder:
#   torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=4 \
#     --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29400 --rdzv-id=lp-job-1 \
#     -m lightning_parallel.cli.train trainer=multinode trainer.devices=4 trainer.num_nodes=2 \
#     strategy=lp_ddp hydra.run.dir=/shared/runs/lp-job-1
