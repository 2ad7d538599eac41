"""The catalogue of misconfigurations: each raises before training starts, naming the offending value
and saying what would work. Strategies of every kind add their rows here."""

import pytest
from lightning.pytorch import Trainer

import lightning_parallel as lp

CATALOGUE = [
    # (id, callable that must raise, exception type, fragments the message must contain)
    ("ddp-bucket-zero", lambda: lp.DDPStrategy(bucket_cap_mb=0), ValueError, ["bucket_cap_mb", "got 0", "default 25"]),
    ("ddp-bucket-type", lambda: lp.DDPStrategy(bucket_cap_mb="big"), ValueError, ["'big'", "positive number"]),
    ("ddp-first-bucket", lambda: lp.DDPStrategy(first_bucket_cap_mb=-1), ValueError, ["first_bucket_cap_mb", "got -1"]),
    ("ddp-comm-hook", lambda: lp.DDPStrategy(comm_hook="int8"), ValueError, ["'int8'", "'fp16'", "'bf16'"]),
    ("start-method", lambda: lp.DDPStrategy(start_method="thread"), ValueError, ["'thread'", "'popen'", "'spawn'"]),
    ("failure-timeout", lambda: lp.DDPStrategy(failure_timeout=0), ValueError, ["failure_timeout", "got 0", "default 60"]),
    ("unknown-kwarg", lambda: lp.DDPStrategy(bucket_size=5), TypeError, ["bucket_size", "bucket_cap_mb"]),
    ("dp-unknown-kwarg", lambda: lp.DataParallelStrategy(bucket_cap_mb=5), TypeError, ["bucket_cap_mb", "failure_timeout"]),
    ("strategy-name", lambda: Trainer(strategy="lp_ddpp", accelerator="cpu", devices=2), ValueError, ["lp_ddpp"]),
]


@pytest.mark.parametrize("name,make,exc,fragments", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_misconfiguration_is_named(name, make, exc, fragments):
    with pytest.raises(exc) as err:
        make()
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"
