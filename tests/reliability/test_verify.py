"""``lightning_parallel.cli.verify``: the user-facing equivalence checker reports ~0 for a synchronous
strategy and a real difference where the parallel run does train differently (per-rank BatchNorm
statistics without ``sync_batchnorm``), so it can tell the two apart."""

from __future__ import annotations

import pytest

from lightning_parallel.cli.verify import main, verify

DATA = "tests.helpers.models:RegressionData"


@pytest.mark.timeout(300)
def test_verify_reports_equivalence_and_difference(capsys):
    rows = verify(
        "tests.helpers.models:MLP",
        DATA,
        strategy="lp_ddp",
        devices=2,
        steps=3,
        data_kwargs={"batch_size": 8, "n": 64},
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["max_param_diff"] for r in rows) <= 1e-10
    assert max(r["loss_diff"] for r in rows) <= 1e-10
    assert abs(rows[0]["loss"] - rows[-1]["loss"]) > 1e-6, "the model must train"

    rows = verify(
        "tests.helpers.models:BatchNormNet",
        DATA,
        strategy="lp_ddp",
        devices=2,
        steps=2,
        data_kwargs={"batch_size": 4, "n": 64},
    )
    assert rows[0]["loss_diff"] > 1e-6 and rows[-1]["max_param_diff"] > 1e-6, rows


@pytest.mark.timeout(60)
def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="devices=1"):
        verify("tests.helpers.models:MLP", DATA, devices=1)
    with pytest.raises(ValueError, match="'tests.helpers.models'"):
        verify("tests.helpers.models", DATA)
    with pytest.raises(SystemExit):
        main(["--strategy", "lp_ddp"])  # --model/--data missing
