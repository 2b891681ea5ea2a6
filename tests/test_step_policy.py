"""The step policy on its own: what it learns from a loop and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ramflow.engine.step_policy import StepItem, StepPolicy


def _opt(*, overlap: bool = True, keep_grads: bool = True, clips: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        overlap=overlap,
        keep_grads=keep_grads,
        clips=clips,
        no_step_depth=0,
        hyperparameters=lambda: [{"lr": 1e-3}],
    )


def _step(policy: StepPolicy, opt, *, modified: bool = False) -> bool:
    needs = policy.check_step(opt.hyperparameters(), modified=modified)
    policy.after_step(opt, modified=modified)
    return needs


def test_one_backward_per_step_becomes_eager():
    policy, opt = StepPolicy(), _opt()
    assert not policy.begin_pass([opt], ring=False, trains_first=True)  # the first step is deferred
    policy.end_pass([opt])
    assert _step(policy, opt)
    assert policy.begin_pass([opt], ring=False, trains_first=True)  # learned: steps during backward
    policy.end_pass([opt])
    assert not _step(policy, opt)  # already stepped


def test_ring_without_kept_gradients_is_eager_from_the_start():
    opt = _opt(keep_grads=False)
    assert StepPolicy().begin_pass([opt], ring=True, trains_first=True)
    assert not StepPolicy().begin_pass([opt], ring=False, trains_first=True)
    # a loop that says it clips holds the first pass's gradients for the clip
    assert not StepPolicy().begin_pass(
        [_opt(keep_grads=False, clips=True)], ring=True, trains_first=True
    )


def test_clipping_defers_and_a_late_clip_is_a_pattern_error():
    policy, opt = StepPolicy(), _opt()
    policy.begin_pass([opt], ring=False, trains_first=True)
    policy.end_pass([opt])
    policy.note_clip()
    _step(policy, opt)
    assert not policy.begin_pass([opt], ring=False, trains_first=True)
    policy.end_pass([opt])
    _step(policy, opt)

    policy, opt = StepPolicy(), _opt()
    policy.begin_pass([opt], ring=False, trains_first=True)
    policy.end_pass([opt])
    _step(policy, opt)
    policy.begin_pass([opt], ring=False, trains_first=True)
    policy.end_pass([opt])
    with pytest.raises(RuntimeError, match="clipped"):
        policy.note_clip()
    policy.zero_grad()  # recovers
    assert not policy.pattern_error and not policy.allowed


def test_a_clip_after_keep_grads_false_under_the_ring_names_the_promise():
    """The first pass under the ring with keep_grads=False is eager on the optimizer's
    promise, not on a pattern seen: a clip then (the Trainer's max_grad_norm > 0, which
    clips from the first step on) is refused with a message that names keep_grads, not one
    that tells the loop to clip from the first step on, which it did."""
    policy, opt = StepPolicy(), _opt(keep_grads=False)
    assert policy.begin_pass([opt], ring=True, trains_first=True)
    policy.end_pass([opt])
    with pytest.raises(RuntimeError, match="keep_grads=False") as err:
        policy.note_clip()
    assert "first step on" not in str(err.value)
    policy.zero_grad()
    policy, opt = StepPolicy(), _opt(keep_grads=False)
    policy.begin_pass([opt], ring=True, trains_first=True)
    policy.end_pass([opt])
    with pytest.raises(RuntimeError, match="keep_grads=True"):
        policy.check_step(opt.hyperparameters(), modified=True)
    # a pass eager on a pattern seen keeps the message about that pattern
    policy, opt = StepPolicy(), _opt()
    for _ in range(2):
        policy.begin_pass([opt], ring=True, trains_first=True)
        policy.end_pass([opt])
        _step(policy, opt)
    assert policy.begin_pass([opt], ring=True, trains_first=True)
    policy.end_pass([opt])
    with pytest.raises(RuntimeError, match="first step on"):
        policy.note_clip()


def test_second_backward_after_an_eager_one_is_refused():
    policy, opt = StepPolicy(), _opt()
    for _ in range(2):
        policy.begin_pass([opt], ring=False, trains_first=True)
        policy.end_pass([opt])
        _step(policy, opt)
    assert policy.begin_pass([opt], ring=False, trains_first=True)
    policy.end_pass([opt])
    with pytest.raises(RuntimeError, match="second backward pass"):
        policy.begin_pass([opt], ring=False, trains_first=True)


def test_step_item_is_read_by_name():
    item = StepItem(_opt(), [{}], [], [], [])
    assert item.hyper == [{}] and item.params == [] and item.versions == []


def test_a_pass_whose_first_unit_the_optimizer_does_not_train_is_deferred():
    """A backward of another model (or one whose optimizer was dropped) never steps during
    backward on this optimizer, and so leaves no eager pass behind for a second backward to
    trip on. See [Note: an optimizer of another model] in ``ramflow.engine.stepper``."""
    policy, opt = StepPolicy(), _opt()
    for _ in range(2):
        policy.begin_pass([opt], ring=False, trains_first=True)
        policy.end_pass([opt])
        _step(policy, opt)
    assert policy.allowed
    for _ in range(2):  # no "second backward pass" error
        assert not policy.begin_pass([opt], ring=False, trains_first=False)
        policy.end_pass([opt])
    promise = _opt(keep_grads=False)
    assert not StepPolicy().begin_pass([promise], ring=True, trains_first=False)
