"""Hydra plugin of lightning_parallel: its strategy and plan configs as the groups ``lp/strategy`` and
``lp/plan`` of any Hydra app (``+lp/strategy@trainer.strategy=lp_pipeline_1f1b``); see ``lp_configs``."""
