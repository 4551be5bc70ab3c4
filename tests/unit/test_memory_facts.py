"""A misleading memory figure found out by its first failure (`scheduler.search.memory_facts`):
once the model over-predicted, a stage that ran nothing is first probed cautiously."""
from __future__ import annotations

from scheduler.search.memory import MemoryModel, ModelInfo, Observation, TrainingSetup
from scheduler.search.memory_facts import model_overpredicted, predict_max_micro_batch_size
from tests.unit.test_memory import FOUR, ZERO_1_BRACKET


def test_a_model_caught_over_predicting_gives_a_stage_that_ran_nothing_a_cautious_first_probe() -> None:
    """ZeRO-1 failed at 60 where the model (no peaks measured) says 190 fit. A stage
    that ran nothing is first probed halfway from what the bracket says it surely holds to the
    optimistic end: ZeRO-2 53 + (64 - 53) // 2 = 58, ZeRO-0 21 + (36 - 21) // 2 = 28. Not cautious (a
    decision, not a probe), or once the stage ran something, the optimistic end as before."""
    assert FOUR.max_micro_batch_size(1, 26000) == 190 and model_overpredicted(FOUR, 26000, ZERO_1_BRACKET)
    assert predict_max_micro_batch_size(FOUR, 2, 26000, ZERO_1_BRACKET, cautious=True) == 58
    assert predict_max_micro_batch_size(FOUR, 0, 26000, ZERO_1_BRACKET, cautious=True) == 28
    assert predict_max_micro_batch_size(FOUR, 2, 26000, ZERO_1_BRACKET) == 64
    ran = {**ZERO_1_BRACKET, 2: [Observation(30)]}
    assert predict_max_micro_batch_size(FOUR, 2, 26000, ran, cautious=True) == 64
    # a model that predicted less than the failure (1000 bytes per sample: ZeRO-1 19) was not caught
    heavy = MemoryModel(ModelInfo(1000, 1000, 1000), TrainingSetup(world_size=4, mixed_precision=True), 0)
    assert not model_overpredicted(heavy, 26000, ZERO_1_BRACKET)
    assert predict_max_micro_batch_size(heavy, 2, 26000, ZERO_1_BRACKET, cautious=True) == 51
