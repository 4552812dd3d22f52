"""CurvatureOptions: every option refused with its typed error, checked once.

A front door (``LowRankGGN``, ``StreamingGGN``, ``DampedNewton``) builds one
:class:`vivit.options.CurvatureOptions`; building it checks every option alone
and together, and nothing below checks them again: ``DampedNewton.step`` and
``LowRankGGN.from_options`` reuse the checked object. A process group of more
than one rank cannot exist inside the test process, so the cross-option refusal
(``chunk_size`` with a group) stands the group in for ``resolve_group``'s answer.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import vivit.options
from tests.fixtures.problems import prepare, select
from vivit import (
    InvalidArgumentError,
    InvalidSubsamplingError,
    LowRankGGN,
    StreamingGGN,
)
from vivit.optim import DampedNewton
from vivit.options import CurvatureOptions

#: One malformed value per option: (keyword, value, error type, message).
MALFORMED = [
    ("mc_samples", -1, InvalidArgumentError, "mc_samples must be an integer >= 0"),
    ("mc_samples", 1.0, InvalidArgumentError, "mc_samples must be an integer >= 0"),
    ("mc_per", "position", InvalidArgumentError, "mc_per must be one of"),
    ("subsampling", [], InvalidSubsamplingError, "subsampling is empty"),
    ("subsampling", [1, 1], InvalidSubsamplingError, r"repeats the sample indices"),
    ("subsampling", [0.5], InvalidSubsamplingError, "integer sample indices"),
    ("generator", 0, InvalidArgumentError, "generator must be a torch.Generator"),
    ("gram_dtype", torch.float16, InvalidArgumentError, "gram_dtype must be None"),
    ("route", "vjp", InvalidArgumentError, "route must be one of"),
    ("solver", "lanczos", InvalidArgumentError, "solver must be one of"),
    ("solver", "iterative", InvalidArgumentError, "is now solver='gram_krylov'"),
    ("solver_tol", 1.0, InvalidArgumentError, r"solver_tol must be a number in \(0"),
    ("solver_seed", 1.5, InvalidArgumentError, "solver_seed must be an integer"),
    ("engine", "jax", InvalidArgumentError, "engine must be one of"),
    ("progress", "yes", InvalidArgumentError, "progress must be True, False or None"),
    ("process_group", "world", InvalidArgumentError, "process_group must be None"),
    ("chunk_size", 0, InvalidArgumentError, "chunk_size must be a positive integer"),
    ("chunk_size", True, InvalidArgumentError, "chunk_size must be a positive integer"),
    ("max_batches", 0, InvalidArgumentError, "max_batches must be a positive int"),
    ("max_batches", 2.0, InvalidArgumentError, "max_batches must be a positive int"),
    ("output", "", InvalidArgumentError, "output must be None"),
    ("output", 1.5, InvalidArgumentError, "output must be None"),
]
OPTIONS = {name for name, *_ in MALFORMED}
assert {f.name for f in dataclasses.fields(CurvatureOptions) if f.init} == OPTIONS, (
    "every option of CurvatureOptions has a malformed value here"
)

#: What ``resolve_group`` answers for a process group of several ranks.
GROUP = object()


def ids(cases):
    return [f"{name}={value!r}" for name, value, *_ in cases]


@pytest.mark.parametrize(
    ("name", "value", "error", "match"), MALFORMED, ids=ids(MALFORMED)
)
def test_every_option_is_refused_with_its_typed_error(name, value, error, match):
    with pytest.raises(error, match=match) as caught:
        CurvatureOptions(**{name: value})
    assert caught.type is error


FRONT_DOORS = [LowRankGGN, StreamingGGN, DampedNewton]
#: Each front door with every malformed value of an option it takes.
REFUSALS = [
    (door, *case)
    for door in FRONT_DOORS
    for case in MALFORMED
    if case[0] in inspect.signature(door).parameters
]


@pytest.mark.parametrize(
    ("front_door", "name", "value", "error", "match"),
    REFUSALS,
    ids=[f"{door.__name__}-{name}={value!r}" for door, name, value, *_ in REFUSALS],
)
def test_front_doors_refuse_before_the_first_pass(
    front_door, name, value, error, match
):
    """Each front door refuses with the options' message, before any pass."""
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)

    class Unread:
        def __iter__(self):
            raise AssertionError("the data was read before the options were checked")

    with pytest.raises(error, match=match):
        if front_door is DampedNewton:
            front_door(
                model.parameters(), model=model, loss_func=loss_func, **{name: value}
            )
        else:
            front_door(model, loss_func, Unread(), **{name: value})


def test_chunk_size_with_a_process_group_is_refused(monkeypatch):
    monkeypatch.setattr(vivit.options, "resolve_group", lambda group: GROUP)
    assert CurvatureOptions(process_group=GROUP).group is GROUP
    with pytest.raises(InvalidArgumentError, match="chunk_size is not supported with"):
        CurvatureOptions(process_group=GROUP, chunk_size=2)
    monkeypatch.setattr(vivit.options, "resolve_group", lambda group: None)
    assert CurvatureOptions(process_group=False, chunk_size=2).group is None


def test_replace_checks_again(monkeypatch):
    options = CurvatureOptions(mc_samples=2, subsampling=[3, 0], chunk_size=2)
    assert options.subsampling == (3, 0)
    changed = options.replace(mc_samples=0, subsampling=[1, 2])
    assert (changed.mc_samples, changed.subsampling, changed.chunk_size) == (
        0,
        (1, 2),
        2,
    )
    assert options.mc_samples == 2, "replace returns a copy"
    with pytest.raises(InvalidArgumentError, match="mc_samples must be"):
        options.replace(mc_samples=-2)
    with pytest.raises(InvalidSubsamplingError, match="repeats"):
        options.replace(subsampling=[1, 1])
    monkeypatch.setattr(vivit.options, "resolve_group", lambda group: GROUP)
    with pytest.raises(InvalidArgumentError, match="chunk_size is not supported with"):
        options.replace(process_group=GROUP)  # each option alone is fine


class Counted:
    """Counts the checks of ``vivit.options`` and the options built."""

    CHECKS = ("check_mc_samples", "check_subsampling", "check_solver", "resolve_group")

    def __init__(self, monkeypatch):
        self.calls = dict.fromkeys((*self.CHECKS, "__post_init__"), 0)
        for name in self.CHECKS:
            monkeypatch.setattr(
                vivit.options, name, self._counting(name, getattr(vivit.options, name))
            )
        post_init = CurvatureOptions.__post_init__
        monkeypatch.setattr(
            CurvatureOptions,
            "__post_init__",
            self._counting("__post_init__", post_init),
        )

    def _counting(self, name, function):
        def counting(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counting

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)


@pytest.mark.parametrize("closure", [False, True], ids=["data", "closure"])
def test_damped_newton_checks_its_options_once(monkeypatch, closure):
    (problem,) = select(architecture="mlp_tanh", loss="mse", reduction="sum")
    model, loss_func, X, y = prepare(problem, torch.float64)
    counted = Counted(monkeypatch)
    if closure:
        optimizer = DampedNewton(model.parameters(), top_k=2, mc_samples=1)
    else:
        optimizer = DampedNewton(
            model.parameters(), top_k=2, mc_samples=1, model=model, loss_func=loss_func
        )
    after_construction = counted.snapshot()
    assert after_construction == dict.fromkeys(after_construction, 1)
    for _ in range(3):
        if closure:
            optimizer.step(lambda: loss_func(model(X), y))
        else:
            optimizer.step(data=(X, y))
    assert counted.snapshot() == after_construction


def test_from_options_does_not_check_again(monkeypatch):
    (problem,) = select(architecture="mlp_tanh", loss="ce", reduction="mean")
    model, loss_func, X, y = prepare(problem, torch.float64)
    options = CurvatureOptions(mc_samples=2, generator=torch.Generator().manual_seed(0))
    counted = Counted(monkeypatch)
    ggn = LowRankGGN.from_options(model, loss_func, (X, y), None, options)
    ggn.eigh(top_k=2)
    assert counted.snapshot() == dict.fromkeys(counted.calls, 0)


def test_replace_refuses_what_is_not_an_option():
    options = CurvatureOptions()
    for name in ("group", "mc_sample"):
        with pytest.raises(InvalidArgumentError, match="not options of a curvature"):
            options.replace(**{name: 1})
