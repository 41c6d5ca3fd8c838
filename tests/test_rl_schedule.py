"""The off-policy schedule (rl/schedule.py): which state each step samples from, the lag, what is submitted when."""

from __future__ import annotations

import pytest

from rollout_lib.rl.schedule import OffPolicySchedule


def test_synchronous_steps_sample_the_state_before_them():
    schedule = OffPolicySchedule(0)
    assert schedule.synchronous
    assert [schedule.sampled_after(step) for step in range(1, 5)] == [0, 1, 2, 3]
    assert [schedule.lag(step) for step in range(1, 5)] == [0, 0, 0, 0]
    assert list(schedule.first_submissions(5)) == [] and schedule.submitted_while_training(3, 5) is None
    assert schedule.frozen_capacity == 2


@pytest.mark.parametrize("k", [1, 2])
def test_k_steps_stale_with_every_sampling_submitted_once_before_it_is_needed(k):
    schedule, total = OffPolicySchedule(k), 6
    assert [schedule.sampled_after(step) for step in range(1, total + 1)] == \
        [max(0, step - 1 - k) for step in range(1, total + 1)]
    assert [schedule.lag(step) for step in range(1, total + 1)] == [min(step - 1, k) for step in range(1, total + 1)]
    submitted = list(schedule.first_submissions(total))
    for step in range(1, total + 1):
        ahead = schedule.submitted_while_training(step, total)
        if ahead is not None:
            # its state exists when it is submitted: the state after step-1, trained before step starts
            assert schedule.sampled_after(ahead) == step - 1
            submitted.append(ahead)
        assert step in submitted  # submitted before it is needed
    assert submitted == list(range(1, total + 1))  # each step once, in order
    assert schedule.frozen_capacity == k + 2


def test_steps_count_from_one_and_k_is_not_negative():
    with pytest.raises(ValueError, match="from 1"):
        OffPolicySchedule(1).sampled_after(0)
    with pytest.raises(ValueError, match=">= 0"):
        OffPolicySchedule(-1)
