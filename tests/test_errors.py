"""Bad input gets a clear exception that says what is wrong and what to do."""

import pytest
import torch
from backpack import backpack, extend
from torch import nn

import vivit.gram.memory
from tests.fixtures.problems import mlp
from vivit import (
    BatchNormTrainingError,
    DirectionalDampedNewtonComputation,
    EighComputation,
    EigvalshComputation,
    GramTooLargeError,
    InvalidArgumentError,
    InvalidSubsamplingError,
    LowRankGGN,
    ParamGroupError,
    ResultNotReadyError,
    UnsupportedLayerError,
)
from vivit.optim import DampedNewton


def mlp_problem(N=4):
    torch.manual_seed(0)
    model = mlp(3, 4, 2, activation=nn.ReLU)
    return model, nn.CrossEntropyLoss(), (torch.randn(N, 3), torch.randint(0, 2, (N,)))


def test_parameter_in_two_groups():
    model, loss_func, data = mlp_problem()
    weight = model[0].weight
    with pytest.raises(ParamGroupError, match="more than one group"):
        LowRankGGN(model, loss_func, data, param_groups=[[weight], [weight]])
    with pytest.raises(ParamGroupError, match="more than one group"):
        EigvalshComputation().get_extension_hook(
            [{"params": [weight]}, {"params": [weight]}]
        )


def test_group_without_criterion():
    model, _, _ = mlp_problem()
    with pytest.raises(ParamGroupError, match="criterion"):
        EighComputation().get_extension_hook([{"params": list(model.parameters())}])


def test_frozen_parameter_in_group():
    model, loss_func, data = mlp_problem()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ParamGroupError, match="does not require gradients"):
        LowRankGGN(model, loss_func, data, param_groups=[[model[0].weight]])


@pytest.mark.parametrize("engine", ["auto", "backpack", "func"])
def test_batchnorm_in_training_mode(engine):
    """Refused before the forward pass: the running statistics stay as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BatchNormTrainingError, match=r"model\.eval\(\)"):
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine=engine)
    with pytest.raises(BatchNormTrainingError):
        DampedNewton(
            model.parameters(), model=model, loss_func=nn.CrossEntropyLoss()
        ).step(data=data)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("engine", ["auto", "backpack", "func"])
def test_batchnorm_without_running_statistics(engine):
    """Eval mode does not help: without running statistics BatchNorm normalizes
    with the batch's (BackPACK used to fail with an AttributeError)."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4, track_running_stats=False)
    model = nn.Sequential(nn.Linear(3, 4), norm, nn.Linear(4, 2)).eval()
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(BatchNormTrainingError, match="track_running_stats=True"):
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine=engine)


@pytest.mark.parametrize(
    "layer, hint",
    [(nn.LayerNorm(4), "LayerNorm"), (nn.GELU(), "GELU")],
    ids=["LayerNorm", "GELU"],
)
def test_unsupported_layer_is_named(layer, hint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2))
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(UnsupportedLayerError, match=hint) as info:
        LowRankGGN(model, nn.CrossEntropyLoss(), data, engine="backpack")
    assert "Supported layers: " in str(info.value) and "Linear" in str(info.value)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(1, 2, 3, padding="same"),
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="circular"),
    ],
    ids=["same", "reflect", "circular"],
)
def test_convolution_padding_backpack_gets_wrong(conv):
    # BackPACK's derivatives silently give wrong columns for these: refuse them.
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(2))
    X = torch.randn(3, 1, 4, 4)
    model(X)
    with pytest.raises(UnsupportedLayerError, match="padding_mode='zeros'"):
        LowRankGGN(
            model,
            nn.CrossEntropyLoss(),
            (X, torch.randint(0, 2, (3,))),
            engine="backpack",
        )


def test_result_before_backward():
    model, _, _ = mlp_problem()
    group = {"params": list(model.parameters()), "criterion": lambda evals: [0]}
    computation = EighComputation()
    computation.get_extension_hook([group])
    with pytest.raises(ResultNotReadyError, match=r"backward\(\)"):
        computation.get_result(group)
    with pytest.raises(KeyError):  # ViViT raised KeyError; scripts may catch it
        EigvalshComputation().get_result(group)


@pytest.mark.parametrize(
    "subsampling, match",
    [
        ([0, 0, 1], r"repeats the sample indices \[0\]"),
        ([1, 4], "outside the mini-batch"),
    ],
    ids=["repeated", "out-of-range"],
)
def test_bad_subsampling(subsampling, match):
    model, loss_func, data = mlp_problem(N=4)
    with pytest.raises(InvalidSubsamplingError, match=match):
        LowRankGGN(model, loss_func, data, subsampling=subsampling)
    ggn = LowRankGGN(model, loss_func, data)
    with pytest.raises(InvalidSubsamplingError, match=match):
        ggn.directional_derivatives(subsampling_grad=subsampling)


def test_out_of_range_subsampling_in_training_loop():
    model, loss_func, (X, y) = mlp_problem(N=4)
    model, loss_func = extend(model), extend(loss_func)
    computation = EigvalshComputation(subsampling=[0, 7])
    groups = [{"params": list(model.parameters())}]
    with (
        pytest.raises(InvalidSubsamplingError, match="outside the mini-batch"),
        backpack(
            computation.get_extension(),
            extension_hook=computation.get_extension_hook(groups),
        ),
    ):
        loss_func(model(X), y).backward()


def test_gram_too_large_is_refused_with_options(monkeypatch):
    # 16 x 16 float32 Gram: 4 squares of 1 KiB do not fit into 1024 bytes.
    monkeypatch.setattr(vivit.gram.memory, "available_bytes", lambda device: 1024)
    model, loss_func, data = mlp_problem(N=8)
    with pytest.raises(GramTooLargeError) as info:  # before the backward pass
        LowRankGGN(model, loss_func, data, solver="dense")
    message = str(info.value)
    for option in ("GiB", "mc_samples=1", "subsampling", "solver='matrix_free'"):
        assert option in message
    ggn = LowRankGGN(model, loss_func, data)  # "auto" forms the Gram on demand
    with pytest.raises(GramTooLargeError):
        ggn.eigvalsh()


def test_gram_that_fits_is_accepted(monkeypatch):
    # 8 x 8 float32 Gram: 4 squares of 256 bytes fit into 1024 bytes.
    monkeypatch.setattr(vivit.gram.memory, "available_bytes", lambda device: 1024)
    model, loss_func, data = mlp_problem(N=4)
    assert LowRankGGN(model, loss_func, data).gram().shape == (8, 8)


@pytest.mark.parametrize("mc_samples", [-1, 1.5, True])
def test_bad_mc_samples(mc_samples):
    with pytest.raises(ValueError, match="mc_samples"):
        EigvalshComputation(mc_samples=mc_samples)


def test_bad_top_k_and_group_index():
    ggn = LowRankGGN(*mlp_problem())
    with pytest.raises(ValueError, match="top_k"):
        ggn.eigh(top_k=0)
    with pytest.raises(IndexError, match="group"):
        ggn.eigvalsh(group=1)


def test_unreduced_loss():
    model, _, data = mlp_problem()
    with pytest.raises(ValueError, match="reduction"):
        LowRankGGN(model, nn.CrossEntropyLoss(reduction="none"), data)


def test_negative_damping():
    ggn = LowRankGGN(*mlp_problem())
    with pytest.raises(ValueError, match="damping must be a number >= 0"):
        ggn.newton_step(damping=-1.0)
    with pytest.raises(ValueError, match="Dampings must be >= 0"):
        ggn.newton_step(damping=lambda evals, *_: -evals)


def test_criterion_selecting_zero_eigenvalue():
    """As in ViViT 1.0 no error: the eigenvalue as computed, a zero direction."""
    model, loss_func, (X, y) = mlp_problem(N=4)
    model, loss_func = extend(model), extend(loss_func)
    computation = EighComputation(warn_small_eigvals=0)
    # cross-entropy with 2 classes: rank ≤ N·(C−1), the smallest Gram eigenvalue is 0
    groups = [{"params": list(model.parameters()), "criterion": lambda evals: [0]}]
    with backpack(
        computation.get_extension(),
        extension_hook=computation.get_extension_hook(groups),
    ):
        loss_func(model(X), y).backward()
    evals, evecs = computation.get_result(groups[0])
    assert evals.shape == (1,) and evals.abs() < 1e-6
    assert all((e == 0).all() for e in evecs)


def test_damped_newton_needs_closure_and_positive_lr():
    model, _, _ = mlp_problem()
    with pytest.raises(ValueError, match="lr"):
        DampedNewton(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="closure"):
        DampedNewton(model.parameters()).step(None)


def test_damped_newton_without_extension():
    model, loss_func, (X, y) = mlp_problem()
    optimizer = DampedNewton(model.parameters())
    with pytest.raises(RuntimeError, match="backpack.extend"):
        optimizer.step(lambda: loss_func(model(X), y))


@pytest.mark.parametrize(
    "closure",
    [
        lambda m, f, X, y: 2 * f(m(X), y),
        lambda m, f, X, y: f(m(X), y) + sum((p**2).sum() for p in m.parameters()),
        lambda m, f, X, y: 10.0 - f(m(X), y),
        lambda m, f, X, y: 0.5 * (f(m(X[:2]), y[:2]) + f(m(X[2:]), y[2:])),
    ],
    ids=["scaled", "regularized", "negated", "two-calls"],
)
def test_closure_loss_must_be_the_loss_modules_output(closure):
    """Anything but the loss module's output (plus a constant) would pair the loss
    module's GGN with another function's gradient: refused, nothing updated."""
    model, loss_func, (X, y) = mlp_problem()
    model, loss_func = extend(model), extend(loss_func)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match="loss module"):
        DampedNewton(model.parameters()).step(lambda: closure(model, loss_func, X, y))
    with pytest.raises(InvalidArgumentError, match="loss module"):
        LowRankGGN.from_loss(
            lambda: closure(model, loss_func, X, y), [list(model.parameters())]
        )
    assert all(map(torch.equal, model.parameters(), before))
    shifted = LowRankGGN.from_loss(
        lambda: loss_func(model(X), y) - 10.0, [list(model.parameters())]
    )
    plain = LowRankGGN.from_loss(
        lambda: loss_func(model(X), y), [list(model.parameters())]
    )
    assert torch.equal(shifted.eigvalsh(), plain.eigvalsh())


@pytest.mark.parametrize("damping", ["1", None, True])
def test_damping_neither_number_nor_callable(damping):
    model, loss_func, (X, y) = mlp_problem()
    with pytest.raises(ValueError, match="damping must be a number"):
        LowRankGGN(model, loss_func, (X, y)).newton_step(damping=damping)
    with pytest.raises(ValueError, match="damping must be a number"):
        DampedNewton(model.parameters(), damping=damping)
    group = {"params": list(model.parameters()), "criterion": list, "damping": damping}
    with pytest.raises(ValueError, match='group\\["damping"\\] must be a number'):
        DirectionalDampedNewtonComputation().get_extension_hook([group])


def test_constant_damping_in_hook_api():
    model, loss_func, (X, y) = mlp_problem()
    model, loss_func = extend(model), extend(loss_func)
    group = {
        "params": list(model.parameters()),
        "criterion": lambda evals: [len(evals) - 1],
        "damping": 0.5,
    }
    computation = DirectionalDampedNewtonComputation()
    with backpack(
        *computation.get_extensions(),
        extension_hook=computation.get_extension_hook([group]),
    ):
        loss_func(model(X), y).backward()
    step = computation.get_result(group)
    expected = LowRankGGN(model, loss_func, (X, y)).newton_step(top_k=1, damping=0.5)
    for s, e in zip(step, expected, strict=True):
        torch.testing.assert_close(s, e)
