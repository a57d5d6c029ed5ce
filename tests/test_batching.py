"""Exact split math, including GRPO (num_generations 2/4/8, world 1/2, grad_accum ≠ steps_per_generation)."""
import pytest

from hf_perf_callbacks.core.batching import Split, exact_splits, is_grpo, next_smaller


def test_plain_trainer_splits():
    assert exact_splits(8) == [Split(8, 1), Split(4, 2), Split(2, 4), Split(1, 8)]
    assert exact_splits(12, world_size=2) == [Split(6, 1), Split(3, 2), Split(2, 3), Split(1, 6)]


def test_a_split_names_its_effective_and_generation_batch():
    assert Split(4, 2).effective_batch() == 8 and Split(4, 2).effective_batch(world_size=2) == 16
    assert Split(4, 2, 3).generation_batch(world_size=2) == 24          # micro × world × steps_per_generation
    assert Split(4, 2).generation_batch(world_size=2) is None            # a plain Trainer generates nothing
    assert Split.generation_steps(24, micro_batch=4, world_size=2) == 3   # its inverse
    assert Split.generation_steps(20, micro_batch=4, world_size=2) is None   # no whole number of steps


@pytest.mark.parametrize("num_generations", [2, 4, 8])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("micro, accum, spg", [(4, 2, 2), (4, 2, 4), (8, 1, 2), (2, 4, 8)])
def test_grpo_splits_keep_effective_and_generation_batch(num_generations, world, micro, accum, spg):
    effective, generation = micro * accum * world, micro * world * spg
    if generation % num_generations:
        with pytest.raises(ValueError, match="whole prompt groups"):
            exact_splits(effective, world, generation, num_generations)
        return
    splits = exact_splits(effective, world, generation, num_generations)
    assert Split(micro, accum, spg) in splits
    for s in splits:
        assert s.micro_batch * s.grad_accum * world == effective
        assert s.micro_batch * world * s.steps_per_generation == generation
        assert s.grad_accum * spg == accum * s.steps_per_generation        # the accum/spg ratio is kept
    assert [s.micro_batch for s in splits] == sorted({s.micro_batch for s in splits}, reverse=True)


def test_grpo_example_values():
    # per-device 4 × accumulation 2, steps_per_generation 4, 8 generations: 8 completions per step, 16 per generation
    assert exact_splits(8, 1, 16, 8) == [Split(8, 1, 2), Split(4, 2, 4), Split(2, 4, 8), Split(1, 8, 16)]
    # two ranks: micro-batches must divide both 8/2 and 16/2
    assert exact_splits(8, 2, 16, 8) == [Split(4, 1, 2), Split(2, 2, 4), Split(1, 4, 8)]


def test_next_smaller_and_the_error_when_none_is_left():
    splits = exact_splits(4)
    assert next_smaller(Split(4, 1), splits) == Split(2, 2)
    with pytest.raises(ValueError, match="no exact split smaller than 1×4"):
        next_smaller(Split(1, 4), splits)


@pytest.mark.parametrize("kwargs, name", [({"effective_batch": 0}, "effective_batch"),
                                          ({"effective_batch": 3, "world_size": 2}, "effective_batch=3"),
                                          ({"effective_batch": 4, "generation_batch": 4, "num_generations": 1},
                                           "num_generations")])
def test_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        exact_splits(**kwargs)


def test_the_run_kind_is_decided_by_num_generations_and_steps_per_generation():
    """GRPO's kin carry both (GRPOConfig, RLOOConfig); a config with num_generations alone (TRL's GOLDConfig, an SFT
    run that samples) has no generation batch spanning steps, so nothing of GRPO's step accounting applies."""
    from types import SimpleNamespace

    assert is_grpo(SimpleNamespace(num_generations=4, steps_per_generation=2))
    assert not is_grpo(SimpleNamespace(num_generations=4))
    assert not is_grpo(SimpleNamespace(per_device_train_batch_size=8))
