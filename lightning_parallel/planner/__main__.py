"""``python -m lightning_parallel.planner``: the layout planner's command (``planner.command``)."""

import sys

from lightning_parallel.planner.command import main

sys.exit(main())
