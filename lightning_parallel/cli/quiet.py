"""Third-party messages that ``lp-train`` users did not ask for, silenced by their exact text only.

- torch's ``FutureWarning`` that Lightning's ``lightning.pytorch.utilities._pytree`` still builds a ``LeafSpec``;
- Lightning's "Tip" lines advertising its cloud products (``rank_zero_info``, once per fit).

Nothing else is filtered: a warning of lightning_parallel, or any other of Lightning's or torch's, shows as
before.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_third_party", "TIP_PREFIX"]

TIP_PREFIX = "\U0001f4a1 Tip:"
# where Lightning's rank_zero_info logs (lightning.pytorch's module replaces fabric's logger with its own)
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


_FILTER = _DropTips()


def quiet_third_party() -> None:
    """Install the filters in this process; safe to call twice."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
