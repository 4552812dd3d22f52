"""CurvatureMonitor in a training loop: its records, its files, training unchanged.

The records are those of direct :class:`vivit.LowRankGGN` calls on the same batch
at the same parameters (the same computation: compared for equality; their
correctness against the dense reference is tests/analysis/test_monitor_record.py).
Training with the monitor gives bit-identical parameters, buffers, gradients and
random number generator states to training without it.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from torch import nn

from tests.fixtures.optional_packages import installed
from vivit import InvalidArgumentError, LowRankGGN, MissingPackageWarning
from vivit.analysis import CurvatureMonitor, read_records
from vivit.analysis.monitor_record import FIELDS, curvature_record

STEPS, EVERY, K, N = 6, 2, 3, 8


def _model():
    """Dropout (random in training) and BatchNorm (batch statistics in training)."""
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(6, 3),
    )


def _data(count=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))
        for _ in range(count)
    ]


def _train(monitor_factory=None, seed=0):
    """SGD with momentum on a dropout + BatchNorm model; the monitor after each step.

    Returns the model, the gradients after every step, the global RNG state at
    the end, and the snapshots (parameters, batch) of the monitored steps.
    """
    torch.manual_seed(seed)
    model, loss_func = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = None if monitor_factory is None else monitor_factory(model, loss_func)
    grads, snapshots = [], []
    for batch in _data():
        optimizer.zero_grad()
        loss_func(model(batch[0]), batch[1]).backward()
        optimizer.step()
        if monitor is not None:
            hooks = _hooks(model)
            if monitor.step(None if monitor.uses_fixed_batch else batch) is not None:
                snapshots.append((copy.deepcopy(model), batch))
            assert _hooks(model) == hooks
            assert model.training and all(m.training for m in model.modules())
        grads.append([p.grad.clone() for p in model.parameters()])
    return model, grads, torch.get_rng_state(), monitor, snapshots


def _hooks(model):
    return [
        (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
        for m in model.modules()
    ]


@pytest.mark.parametrize(
    "options", [{}, {"mc_samples": 1}, {"engine": "func"}], ids=["exact", "mc", "func"]
)
def test_training_is_bit_identical_with_the_monitor(options, tmp_path):
    plain, plain_grads, plain_rng, _, _ = _train()

    def factory(model, loss_func):
        return CurvatureMonitor(
            model, loss_func, every=EVERY, top_k=K, path=tmp_path / "r.jsonl", **options
        )

    monitored, grads, rng, monitor, _ = _train(factory)
    assert len(monitor.records) == STEPS // EVERY
    assert torch.equal(rng, plain_rng)  # dropout masks and MC: same global stream
    states = (plain.state_dict().values(), monitored.state_dict().values())
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)  # parameters and BatchNorm's running statistics
    for step_a, step_b in zip(plain_grads, grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))


def _direct(model, loss_func, batch, generator=None, **options):
    model.eval()
    ggn = LowRankGGN(model, loss_func, batch, generator=generator, **options)
    return curvature_record(ggn, K, 1.0)


@pytest.mark.parametrize(
    "options",
    [{}, {"mc_samples": 2}, {"subsampling": [1, 3, 4, 6]}],
    ids=["exact", "mc", "subsampled"],
)
def test_records_equal_direct_lowrank_calls(options):
    _, _, _, monitor, snapshots = _train(
        lambda model, loss_func: CurvatureMonitor(
            model, loss_func, every=EVERY, top_k=K, seed=5, **options
        )
    )
    # the monitor's own generator, seeded with `seed`, draws once per record
    generator = torch.Generator().manual_seed(5) if "mc_samples" in options else None
    assert [r["step"] for r in monitor.records] == [2, 4, 6]
    for record, (model, batch) in zip(monitor.records, snapshots, strict=True):
        direct = _direct(model, nn.CrossEntropyLoss(), batch, generator, **options)
        assert {k: record[k] for k in direct} == direct
        assert record["batch"] == "current" and record["overhead_s"] > 0


def test_fixed_monitoring_batch():
    fixed = _data(1, seed=7)[0]
    _, _, _, monitor, snapshots = _train(
        lambda model, loss_func: CurvatureMonitor(
            model, loss_func, every=EVERY, top_k=K, batch=fixed
        )
    )
    for record, (model, _) in zip(monitor.records, snapshots, strict=True):
        direct = _direct(model, nn.CrossEntropyLoss(), fixed)
        assert {k: record[k] for k in direct} == direct
        assert record["batch"] == "fixed"
    with pytest.raises(InvalidArgumentError, match="fixed monitoring batch"):
        monitor.step(fixed)


def test_fixed_batch_changed_by_the_caller_changes_no_record():
    """The fixed batch is kept as given: in-place changes afterwards are not read."""
    fixed = _data(1, seed=7)[0]
    given = tuple(t.clone() for t in fixed)
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    monitor = CurvatureMonitor(model, loss_func, every=1, top_k=K, batch=given)
    given[0].mul_(-3.0)  # the caller reuses its buffer
    record = monitor.record()
    direct = _direct(model, loss_func, fixed)
    assert {k: record[k] for k in direct} == direct


def test_current_batch_is_required():
    monitor = CurvatureMonitor(_model(), nn.CrossEntropyLoss(), every=3)
    with pytest.raises(InvalidArgumentError, match="pass the batch the step"):
        monitor.step()  # not a monitored step: refused all the same


def test_schedule_and_explicit_indices():
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    batch = _data(1)[0]
    monitor = CurvatureMonitor(model, loss_func, every=3, top_k=K)
    monitor.record(batch)  # before training
    taken = [monitor.step(batch) is not None for _ in range(7)]
    assert taken == [False, False, True, False, False, True, False]
    assert monitor.step(batch, index=30) is not None
    assert monitor.step(batch) is None  # counts on from 30
    assert [r["step"] for r in monitor.records] == [0, 3, 6, 30]
    with pytest.raises(InvalidArgumentError, match="index must be"):
        monitor.step(batch, index=-1)


def test_json_lines_schema_and_reading_back(tmp_path):
    path = tmp_path / "sub" / "records.jsonl"
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    with CurvatureMonitor(model, loss_func, every=1, top_k=K, path=path) as monitor:
        for batch in _data(3):
            monitor.step(batch)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    for line in lines:
        parsed = json.loads(line)
        assert set(parsed) == set(FIELDS)
        assert len(parsed["eigenvalues"]) == K
        assert parsed["eigenvalues"] == sorted(parsed["eigenvalues"], reverse=True)
        for key in ("gamma_snr", "lambda_snr", "dampings"):
            assert len(parsed[key]) == K
        assert 0 <= parsed["newton_angle_deg"] <= 90
    assert read_records(path) == monitor.records
    # appended to, not overwritten: the new monitor's run follows the first
    with CurvatureMonitor(model, loss_func, every=1, top_k=K, path=path) as monitor:
        monitor.step(_data(1)[0])
    assert len(read_records(path, run="all")) == 4
    assert read_records(path) == monitor.records


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "line 2 is not JSON"),
        ("[1, 2]", "line 2 is not a monitoring record"),
        ('{"step": 1}', "line 2 lacks the field"),
    ],
)
def test_reading_malformed_records(tmp_path, line, match):
    path = tmp_path / "records.jsonl"
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    with CurvatureMonitor(model, loss_func, every=1, top_k=K, path=path) as monitor:
        monitor.step(_data(1)[0])
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(InvalidArgumentError, match=match):
        read_records(path)


def test_reading_a_wrongly_typed_field(tmp_path):
    path = tmp_path / "records.jsonl"
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    record = CurvatureMonitor(model, loss_func, top_k=K).record(_data(1)[0])
    path.write_text(json.dumps({**record, "eigenvalues": "big"}) + "\n")
    with pytest.raises(InvalidArgumentError, match="'eigenvalues' must be list"):
        read_records(path)
    with pytest.raises(InvalidArgumentError, match="not a file"):
        read_records(tmp_path / "missing.jsonl")


def test_tensorboard_missing_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    with pytest.warns(MissingPackageWarning, match="pip install tensorboard") as seen:
        monitor = CurvatureMonitor(
            model, loss_func, every=1, top_k=K, path=tmp_path / "r.jsonl",
            tensorboard=tmp_path / "tb",
        )  # fmt: skip
        for batch in _data(2):
            monitor.step(batch)
    assert len(seen) == 1
    assert len(read_records(tmp_path / "r.jsonl")) == 2


def test_tensorboard_scalars(tmp_path):
    installed("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    model, loss_func = _model().eval(), nn.CrossEntropyLoss()
    with CurvatureMonitor(
        model, loss_func, every=1, top_k=K, tensorboard=tmp_path
    ) as monitor:
        for batch in _data(2):
            monitor.step(batch)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    sharpness = events.Scalars("monitor/eigenvalues/1")
    assert [e.step for e in sharpness] == [1, 2]
    # TensorBoard keeps a scalar as float32: the record's number rounded once to
    # nearest, and nothing else (docs/math.rst, "Tolerances of the tests", "Few
    # operations": the float32 value is exact; no tolerance).
    expected = [
        torch.tensor(r["eigenvalues"][0], dtype=torch.float32).item()
        for r in monitor.records
    ]
    assert [e.value for e in sharpness] == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "every must be a positive integer"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"damping": -1.0}, "damping must be a number"),
        ({"seed": 1.5}, "seed"),
        ({"mc_sample": 1}, "Unknown option"),
        ({"mc_samples": -1}, "mc_samples"),
    ],
)
def test_malformed_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        CurvatureMonitor(_model(), nn.CrossEntropyLoss(), **kwargs)
