"""LightningCLI with a lightning_parallel strategy picked on the command line, with its init args.

    python examples/lightning_cli/main.py fit --trainer.accelerator cpu --trainer.devices 2 \
        --trainer.strategy lightning_parallel.TensorParallelStrategy \
        --trainer.strategy.tensor_parallel_size 2 --trainer.max_steps 20

(needs ``pip install "jsonargparse[signatures]"``, LightningCLI's own dependency)
"""

from lightning.pytorch.cli import LightningCLI

import lightning_parallel  # noqa: F401  (registers the strategy names: --trainer.strategy lp_ddp works too)
from lightning_parallel.data import CharCorpusData
from lightning_parallel.models.gpt import CharGPT

if __name__ == "__main__":
    LightningCLI(CharGPT, CharCorpusData, save_config_kwargs={"overwrite": True})
