"""Every layer the engine supports, in float64, against the dense GGN.

The registry problems cover the common architectures in depth; here each
remaining supported layer (and unusual hyperparameters of the common ones)
appears once, so a layer whose module extension is missing or wrong fails here.
"""

import pytest
import torch
from torch import nn

from tests.fixtures.checks import (
    EIGVAL_RTOL,
    assert_eigenpairs,
    assert_top_eigvals,
)
from tests.fixtures.reference import dense_ggn
from vivit import LowRankGGN
from vivit.engines.backpack import GramGGN


def image(channels, size):
    return lambda N: torch.randn(N, channels, size, size)


LAYERS = {
    "conv2d-stride-dilation-groups": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2, bias=False),
            nn.Flatten(),
            nn.LazyLinear(3),
        ),
        image(2, 6),
    ),
    "conv1d-no-bias": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 2, bias=False), nn.Flatten(), nn.LazyLinear(3)
        ),
        lambda N: torch.randn(N, 2, 5),
    ),
    "convtranspose1d": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 2, 3), nn.Flatten(), nn.LazyLinear(3)
        ),
        lambda N: torch.randn(N, 2, 4),
    ),
    "convtranspose2d": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 2, 2, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.LazyLinear(3),
        ),
        image(2, 3),
    ),
    "convtranspose3d": (
        lambda: nn.Sequential(
            nn.ConvTranspose3d(1, 2, 2), nn.Flatten(), nn.LazyLinear(3)
        ),
        lambda N: torch.randn(N, 1, 2, 2, 2),
    ),
    "embedding": (
        lambda: nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(12, 3)),
        lambda N: torch.randint(0, 7, (N, 4)),
    ),
    "batchnorm3d": (
        lambda: nn.Sequential(
            nn.Conv3d(1, 2, 2), nn.BatchNorm3d(2), nn.Flatten(), nn.LazyLinear(3)
        ),
        lambda N: torch.randn(N, 1, 3, 3, 3),
    ),
    "pooling-1d-3d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 2, 1),
            nn.MaxPool1d(2),
            nn.AvgPool1d(2),
            nn.Flatten(),
            nn.LazyLinear(3),
        ),
        lambda N: torch.randn(N, 2, 8),
    ),
    "pooling-3d": (
        lambda: nn.Sequential(
            nn.Conv3d(1, 2, 1),
            nn.AvgPool3d(2),
            nn.MaxPool3d(1),
            nn.Flatten(),
            nn.LazyLinear(3),
        ),
        lambda N: torch.randn(N, 1, 4, 4, 4),
    ),
    "activations-dropout-zeropad": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 2, 2),
            nn.ZeroPad2d(1),
            nn.LeakyReLU(),
            nn.ELU(),
            nn.SELU(),
            nn.LogSigmoid(),
            nn.Dropout(0.5),
            nn.Flatten(),
            nn.Identity(),
            nn.LazyLinear(3),
        ),
        image(1, 3),
    ),
}


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_layer(name, reduction):
    build, make_inputs = LAYERS[name]
    torch.manual_seed(0)
    N = 3
    model = build()
    inputs = make_inputs(N)
    model(inputs)  # materialize lazy layers
    model = model.double().eval()
    if inputs.is_floating_point():
        inputs = inputs.double()
    for module in model.modules():  # non-trivial BatchNorm statistics
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
            nn.init.uniform_(module.weight, 0.5, 2)
            nn.init.uniform_(module.bias, -1, 1)
    targets = torch.randint(0, 3, (N,))
    loss_func = nn.CrossEntropyLoss(reduction=reduction)

    G = dense_ggn(model, loss_func, inputs, targets)
    ggn = LowRankGGN(model, loss_func, (inputs, targets))
    reference = torch.linalg.eigvalsh(G)
    assert_top_eigvals(ggn.eigvalsh(), reference, EIGVAL_RTOL[torch.float64])
    evals, evecs = ggn.eigh()
    assert_eigenpairs(evals, evecs, G, ggn.eigvalsh().numel())


def test_every_parameterized_layer_saves_contributions():
    """No layer with parameters may fall back to BackPACK's SqrtGGN (raw V)."""
    from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule

    extension = GramGGN()
    table = vars(extension)["_BackpropExtension__module_extensions"]
    raw = [
        layer.__name__
        for layer, module_extension in table.items()
        if isinstance(module_extension, SqrtGGNBaseModule)
        and module_extension._ModuleExtension__params
    ]
    assert raw == []


@pytest.mark.parametrize("subsampling", [None, [2, 0]], ids=["all", "subsampled"])
def test_max_pooling_reuses_the_forward_indices(monkeypatch, subsampling):
    """Max pooling backpropagates with the argmax indices of the forward pass.

    BackPACK's own way (pooling again) is switched off: the GGN must still be
    exact, so the saved indices are used and belong to this forward pass (also
    with subsampling), and no layer keeps them afterwards.
    """
    from backpack.core.derivatives.maxpoolnd import MaxPoolNDDerivatives

    from vivit.engines.backpack.table import POOL_INDICES

    def recompute(*args, **kwargs):
        raise AssertionError("max pooling recomputed its indices")

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 2),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(18, 3),
    ).double()
    model3d = nn.Sequential(
        nn.Conv3d(1, 2, 1), nn.MaxPool3d(2), nn.Flatten(), nn.Linear(16, 3)
    ).double()
    monkeypatch.setattr(MaxPoolNDDerivatives, "get_pooling_idx", recompute)
    for net, inputs in [
        (model, torch.randn(3, 1, 6, 6, dtype=torch.float64)),
        (model3d, torch.randn(3, 1, 4, 4, 4, dtype=torch.float64)),
    ]:
        targets = torch.randint(0, 3, (3,))
        loss_func = nn.CrossEntropyLoss()
        G = dense_ggn(net, loss_func, inputs, targets, subsampling=subsampling)
        ggn = LowRankGGN(net, loss_func, (inputs, targets), subsampling=subsampling)
        # float64 throughout: the spectra agree to rounding
        # (see tests/fixtures/checks.py)
        assert_top_eigvals(
            ggn.eigvalsh(), torch.linalg.eigvalsh(G), EIGVAL_RTOL[torch.float64]
        )
        assert not any(hasattr(m, POOL_INDICES) for m in net.modules())
