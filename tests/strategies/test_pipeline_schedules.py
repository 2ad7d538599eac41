"""The interleaved and zero-bubble schedules (``interleaved_1f1b``, ``zb_h1``, ``zbv``) equal single-device
training on real gloo processes: float64, 5 steps, the full gathered checkpoint against one device to 1e-10,
on 2 stages (GPT-style and ``nn.Sequential`` models, m = 4 and 8, with validation and gradient
accumulation), on 4 stages, in dp2 x pp2 with ZeRO-1 and recompute, and through ``lp_parallel`` with the
Hugging Face Llama-style model built on meta (2 and 4 stages, m = 4 and 8, dp2 x pp2, tp2 x pp2) and the GPT
in 2x2x2. Each stage holds no more activations than the schedule's bound."""

from __future__ import annotations

import pytest

from lightning_parallel.pipeline.schedules import SCHEDULES, activation_bound
from tests.helpers.harness import assert_params_close, run_distributed, saved_checkpoint, training_key
from tests.strategies.test_parallel_3d import DDP, PARALLEL, layout
from tests.strategies.test_parallel_3d import case as parallel_case
from tests.strategies.test_pipeline import case, check

NEW = [s for s in ("interleaved_1f1b", "zb_h1", "zbv") if s in SCHEDULES]
CHUNKS = {"interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}  # chunks per rank of each


def blocks(schedule: str, stages: int) -> dict:
    """Enough blocks for every virtual stage: the GPT's ``n_layer`` / the Sequential's ``depth``."""
    return {"n_layer": stages * CHUNKS[schedule]}


CASES_2 = (
    [
        case(f"gpt-{s}-m{m}", "gpt", schedule=s, num_microbatches=m, model_kwargs=blocks(s, 2))
        for s in NEW
        for m in (4, 8)
    ]
    + [
        case(
            f"seq-{s}-validate",
            "seq",
            schedule=s,
            num_microbatches=4,
            model_kwargs={"depth": 2 * CHUNKS[s]},
            trainer={"limit_val_batches": 2},
            validate_after_fit=True,
        )
        for s in NEW
    ]
    + [
        case(
            f"gpt-{s}-accumulate",
            "gpt",
            schedule=s,
            num_microbatches=4,
            model_kwargs=blocks(s, 2),
            trainer={"accumulate_grad_batches": 2},
        )
        for s in NEW
    ]
)
for c in CASES_2:
    c["probe"] = "tests.helpers.probes:pipeline_peak_held"

CASES_4 = [
    case(
        f"gpt-{s}-pp4",
        "gpt",
        schedule=s,
        num_microbatches=8,
        pipeline_parallel_size=4,
        model_kwargs=blocks(s, 4),
    )
    for s in NEW
] + [
    case(
        f"gpt-{s}-dp2-zero1-recompute",
        "gpt",
        dp=2,
        schedule=s,
        num_microbatches=4,
        model_kwargs=blocks(s, 2),
        zero_stage=1,
        activation_checkpointing=True,
    )
    for s in NEW
]


def composed(name: str, model: str, schedule: str, dp: int, tp: int, pp: int, m: int) -> dict:
    """``lp_parallel`` at dp x tp x pp, the model built on meta, with blocks enough for every virtual stage."""
    c = parallel_case(name, model, PARALLEL, {**layout(dp, tp, pp, schedule), "num_microbatches": m}, dp)
    key = "layers" if model == "llama" else "n_layer"
    c["model_kwargs"] = {**c["model_kwargs"], key: pp * CHUNKS[schedule]}
    return c


COMPOSED = {  # world size: lp_parallel cases, each compared with the same model trained on one process
    2: [composed(f"llama-pp2-{s}-m{m}", "llama", s, 1, 1, 2, m) for s in NEW for m in (4, 8)],
    4: [composed(f"llama-pp4-{s}-m{m}", "llama", s, 1, 1, 4, m) for s in NEW for m in (4, 8)]
    + [composed(f"llama-tp2pp2-{s}", "llama", s, 1, 2, 2, 4) for s in NEW]
    + [composed(f"llama-dp2pp2-{s}", "llama", s, 2, 1, 2, 4) for s in NEW],
    8: [composed(f"gpt-2x2x2-{s}", "gpt", s, 2, 2, 2, 4) for s in NEW],
}
REFERENCES: dict[str, dict] = {}  # by training: composed cases of the same model, data and steps share one
REFERENCE_OF: dict[str, str] = {}  # composed case: the name of its reference
for _cases in COMPOSED.values():
    for _c in _cases:
        _ref = {**_c, "name": f"ref-{_c['name']}", "strategy": {"class": DDP, "kwargs": {}}, "dp_size": 1}
        REFERENCE_OF[_c["name"]] = REFERENCES.setdefault(training_key(_ref), _ref)["name"]
ALL_COMPOSED = [(world, c) for world, cases in COMPOSED.items() for c in cases]


@pytest.fixture(scope="module")
def runs2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules2")
    return tmp, run_distributed(CASES_2, world_size=2, tmp_path=tmp, timeout=600)


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules4")
    return tmp, run_distributed(CASES_4, world_size=4, tmp_path=tmp, timeout=600)


@pytest.fixture(scope="module")
def composed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules_composed")
    run_distributed(list(REFERENCES.values()), world_size=1, tmp_path=tmp, timeout=600)
    for world, cases in COMPOSED.items():
        run_distributed(cases, world_size=world, tmp_path=tmp, timeout=600)
    return tmp


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("c", CASES_2, ids=[c["name"] for c in CASES_2])
def test_two_stages_match_single_device(runs2, c):
    tmp, results = runs2
    check(tmp, results, 2, c)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("c", CASES_4, ids=[c["name"] for c in CASES_4])
def test_four_processes_match_single_device(runs4, c):
    tmp, results = runs4
    check(tmp, results, 4, c)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world,c", ALL_COMPOSED, ids=[c["name"] for _, c in ALL_COMPOSED])
def test_lp_parallel_layouts_built_on_meta_match_one_device(composed_runs, world, c):
    full = saved_checkpoint(composed_runs, world, c["name"])["state_dict"]
    reference = saved_checkpoint(composed_runs, 1, REFERENCE_OF[c["name"]])["state_dict"]
    assert_params_close(full, reference, atol=1e-10)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("s", NEW)
def test_activations_held_stay_within_the_schedules_bound(runs2, s):
    """Counted while the steps ran, in (micro-batch, chunk) units: at most the schedule's bound
    (``activation_bound``: 1F1B's p - stage for ZB-H1 too, Megatron's warm-up + 1 for interleaved), on
    every step and stage."""

    _, results = runs2
    per_rank = [r["probe"] for r in results[f"gpt-{s}-m8"]]
    for stage, steps in enumerate(per_rank):
        bound = activation_bound(s, 2, 8, stage, CHUNKS[s])
        assert len(steps) == 5 and max(steps) <= bound, (s, stage, steps, bound)
