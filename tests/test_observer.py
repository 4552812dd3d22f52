"""The observer's contract (``docs/guide.rst``): measuring changes nothing.

Every front door, over a mini-batch and over loaders, leaves the parameters, their
``.grad``, the buffers, the training flags, the hooks, torch's global generators
and a loader's own generator exactly as they were (compared for equality); the
caller's forward runs as often as the guide says; training with measurements in
the loop gives bit-identical parameters to training without them.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vivit import LowRankGGN, StreamingGGN
from vivit.analysis import CurvatureMonitor
from vivit.linalg.solver_report import default_tolerance
from vivit.memory import estimate_memory
from vivit.optim import DampedNewton

N, D_IN, C, K = 12, 5, 3, 2


class Counted(nn.Module):
    """An MLP with BatchNorm and dropout whose forward counts its runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(D_IN, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.25)
        )
        self.head = nn.Linear(6, C)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.head(self.body(x))


def _problem(seed=0):
    torch.manual_seed(seed)
    model = Counted().double()
    with torch.no_grad():  # running statistics that are not the defaults
        model.body[1].running_mean.normal_()
        model.body[1].running_var.uniform_(0.5, 2.0)
    inputs = torch.randn(N, D_IN, dtype=torch.float64)
    return model.eval(), nn.CrossEntropyLoss(), inputs, torch.randint(0, C, (N,))


def _loaders(inputs, targets):
    dataset = TensorDataset(inputs, targets)
    return {
        "batch": (inputs, targets),
        "shuffled": DataLoader(dataset, batch_size=5, shuffle=True),
        "own-generator": DataLoader(
            dataset,
            batch_size=5,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
        ),
    }


def _state(model, data):
    """Everything a measurement must leave as it was."""
    generator = getattr(data, "generator", None)
    return {
        "tensors": [t.detach().clone() for t in model.state_dict().values()],
        "grads": [
            None if p.grad is None else p.grad.clone() for p in model.parameters()
        ],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "module_hooks": [
            {k: list(v) for k, v in vars(m).items() if k.endswith("hooks")}
            for m in model.modules()
        ],
        "tensor_hooks": [
            (list(p._backward_hooks or {}), list(p._post_accumulate_grad_hooks or {}))
            for p in model.parameters()
        ],
        "global_rng": torch.get_rng_state(),
        "loader_rng": None if generator is None else generator.get_state(),
    }


def _assert_same(before, after):
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if key in ("tensors", "grads"):
            for a, b in zip(value, other, strict=True):
                assert (a is None and b is None) or torch.equal(a, b), key
        elif key in ("global_rng", "loader_rng"):
            assert (value is None and other is None) or torch.equal(value, other), key
        else:
            assert value == other, key


def _with_user_state(model):
    """Gradients, hooks and a training flag of the caller's own, to be kept."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model.head.weight.register_hook(lambda grad: None)
    model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    model.body[3].train()  # dropout on, the rest in evaluation mode
    return model


ROUTES = [
    {"engine": "backpack"},
    {"engine": "func"},
    {"route": "implicit"},
    {"mc_samples": 1, "generator": torch.Generator().manual_seed(1)},
    {"chunk_size": 4, "engine": "func"},
]


@pytest.mark.filterwarnings("ignore:.*random")
@pytest.mark.parametrize("kind", ["batch", "shuffled", "own-generator"])
@pytest.mark.parametrize("options", ROUTES, ids=lambda o: "-".join(map(str, o)))
def test_lowrank_results_leave_everything_as_it_was(options, kind):
    model, loss_func, inputs, targets = _problem()
    model.body[3].eval()  # BackPACK refuses nothing, the func engine random layers
    data = _loaders(inputs, targets)[kind]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model.head.weight.register_hook(lambda grad: None)
    before = _state(model, data)
    ggn = LowRankGGN(model, loss_func, data, **options)
    ggn.eigh(top_k=K)
    ggn.directional_derivatives(top_k=K)
    ggn.newton_step(top_k=K)
    _assert_same(before, _state(model, data))


@pytest.mark.parametrize("kind", ["shuffled", "own-generator"])
def test_streaming_leaves_everything_as_it_was(kind):
    model, loss_func, inputs, targets = _problem()
    data = _loaders(inputs, targets)[kind]
    model = _with_user_state(model)
    model.body[3].eval()
    before = _state(model, data)
    StreamingGGN(model, loss_func, data).eigh(top_k=K)
    _assert_same(before, _state(model, data))


@pytest.mark.parametrize("kind", ["batch", "shuffled", "own-generator"])
def test_a_loaders_passes_yield_the_order_of_the_state_at_construction(kind):
    """Every pass of one computation sees one order: a multi-pass source runs."""
    model, loss_func, inputs, targets = _problem()
    data = _loaders(inputs, targets)[kind]
    stored, _ = LowRankGGN(model, loss_func, data, engine="func").eigh(top_k=K)
    streamed, _ = StreamingGGN(model, loss_func, data).eigh(top_k=K)  # many passes
    # two runs: within 2·tol·λ_max (docs/math.rst, "Tolerances of the tests")
    tol = 2 * default_tolerance(torch.float64) * stored.abs().max()
    torch.testing.assert_close(streamed, stored, rtol=0, atol=tol)


def test_the_monitor_and_the_estimate_leave_everything_as_it_was():
    model, loss_func, inputs, targets = _problem()
    model = _with_user_state(model).train()
    loader = _loaders(inputs, targets)["shuffled"]
    before = _state(model, loader)
    monitor = CurvatureMonitor(model, loss_func, every=1, top_k=K, batch=loader)
    monitor.step()
    CurvatureMonitor(model, loss_func, every=1, top_k=K, mc_samples=1).step(
        (inputs, targets)
    )
    _assert_same(before, _state(model, loader))
    model.eval()
    before = _state(model, loader)
    estimate_memory(model, inputs[:2], N, loss_func=loss_func, route="auto")
    _assert_same(before, _state(model, loader))


@pytest.mark.filterwarnings("ignore::vivit.UnboundedStepWarning")
def test_damped_newton_changes_the_parameters_alone():
    model, loss_func, inputs, targets = _problem()
    model = _with_user_state(model)
    model.body[3].eval()
    before = _state(model, None)
    expected = LowRankGGN(model, loss_func, (inputs, targets)).newton_step(top_k=K)
    optimizer = DampedNewton(
        model.parameters(), top_k=K, trust_fraction=None, model=model,
        loss_func=loss_func,
    )  # fmt: skip
    before_step = [p.detach().clone() for p in model.parameters()]
    optimizer.step(data=(inputs, targets))
    after = _state(model, None)
    for p, p0, step in zip(model.parameters(), before_step, expected, strict=True):
        torch.testing.assert_close(p.detach(), p0 + step, rtol=0, atol=0)
    after["tensors"] = before["tensors"] = [b for _, b in model.named_buffers()]
    _assert_same(before, after)


class RootHooked(Counted):
    """A ``Counted`` model whose root forward hook counts its calls too."""

    def __init__(self):
        super().__init__()
        self.hooked = 0
        self.register_forward_hook(lambda *_: setattr(self, "hooked", self.hooked + 1))


@pytest.mark.parametrize(
    ("options", "runs"),
    [
        ({"engine": "backpack"}, 1),  # its one pass
        ({"engine": "func"}, 2),  # the pass and the check of independent samples
        ({"route": "implicit"}, 2),  # the same two, before any product
        ({}, 2),  # engine="auto", route="auto": the plan measures a copy
    ],
    ids=["backpack", "func", "implicit", "auto"],
)
def test_the_callers_forward_runs_as_often_as_the_math_needs(options, runs):
    """Probes (tracing, the plan's measurement, checks) run on a copy."""
    model, loss_func, inputs, targets = _problem()
    hooked = options.get("engine") != "backpack"  # BackPACK refuses forward hooks
    if hooked:
        model = RootHooked().double().eval()
    counts = []
    model.head.weight.register_hook(lambda grad: counts.append(1))
    LowRankGGN(model, loss_func, (inputs, targets), **options)
    assert model.runs <= runs  # BackPACK runs its conversion of a traced forward
    assert not hooked or model.hooked == model.runs  # no probe fires the hooks
    assert len(counts) == 1  # the tensor hook: the one backward pass


def _train(measure, steps=8, seed=0):
    """SGD on a dropout model over a shuffled loader, measuring every 3 steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(D_IN, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, C)
    )
    inputs, targets = torch.randn(32, D_IN), torch.randint(0, C, (32,))
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    fixed = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    loss_func = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = measure(model, loss_func, fixed) if measure else None
    epochs = (batch for _ in range(steps) for batch in loader)
    for step, (x, y) in zip(range(steps), epochs, strict=False):
        optimizer.zero_grad()
        loss_func(model(x), y).backward()
        optimizer.step()
        if monitor is not None and step % 3 == 2:
            monitor((x, y))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _lowrank(data_of):
    def measure(model, loss_func, fixed):
        def record(batch):
            training = model.training
            model.eval()
            LowRankGGN(model, loss_func, data_of(batch, fixed)).eigh(top_k=K)
            model.train(training)

        return record

    return measure


def _monitor(fixed_batch, **options):
    """The monitor on the current batch, or on a fixed ``"loader"`` or ``"batch"``."""

    def measure(model, loss_func, fixed):
        batch = {"loader": fixed, "batch": fixed.dataset[:8]}.get(fixed_batch)
        monitor = CurvatureMonitor(
            model, loss_func, every=1, top_k=K, batch=batch, **options
        )
        return lambda current: monitor.step(None if fixed_batch else current)

    return measure


@pytest.mark.parametrize(
    "measure",
    [
        _monitor(None),
        _monitor("batch"),
        _monitor("loader"),
        _monitor(None, mc_samples=1),
        _lowrank(lambda batch, fixed: batch),
        _lowrank(lambda batch, fixed: fixed),
    ],
    ids=[
        "monitor-current",
        "monitor-fixed-batch",
        "monitor-shuffled-loader",
        "monitor-mc",
        "lowrank-batch",
        "lowrank-loader",
    ],
)
def test_training_with_measurements_is_bit_identical(measure):
    assert torch.equal(_train(measure), _train(None))


def _newton_training(step_with_optimizer, steps=6):
    """Damped Newton steps over a shuffled loader, inputs jittered by the global RNG."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, C))
    inputs, targets = torch.randn(24, D_IN), torch.randint(0, C, (24,))
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    loss_func = nn.CrossEntropyLoss()
    optimizer = DampedNewton(
        model.parameters(), top_k=K, model=model, loss_func=loss_func
    )
    epochs = (batch for _ in range(steps) for batch in loader)
    for _, (x, y) in zip(range(steps), epochs, strict=False):
        x = x + 0.01 * torch.randn_like(x)  # the training's own draws
        if step_with_optimizer:
            optimizer.step(data=(x, y))
            continue
        with torch.random.fork_rng():  # the measurement counted out by hand
            ggn = LowRankGGN(model, loss_func, (x, y))
            step = ggn.newton(K, max_decrease=0.25 * float(ggn.loss)).step
        with torch.no_grad():
            for param, update in zip(model.parameters(), step, strict=True):
                param.add_(update)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_damped_newton_training_draws_nothing_of_its_own():
    """The optimizer's measurement draws none of the training's random numbers."""
    assert torch.equal(_newton_training(True), _newton_training(False))


class Uncopyable(nn.Module):
    """A model holding an attribute ``copy.deepcopy`` refuses (a lock)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, 6), nn.Tanh(), nn.Linear(6, C))
        self.lock = threading.Lock()

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize(
    "options", [{"engine": "backpack"}, {"engine": "func"}, {"route": "implicit"}]
)
def test_a_model_that_cannot_be_copied_is_probed_as_it_is(options):
    """Its probes run on the model itself; the results are those of its copy."""
    _, loss_func, inputs, targets = _problem()
    torch.manual_seed(0)
    model = Uncopyable().double()
    twin = Uncopyable().double()
    twin.load_state_dict(model.state_dict())
    del twin.lock  # the same model, copyable
    evals, _ = LowRankGGN(model, loss_func, (inputs, targets), **options).eigh(top_k=K)
    expected, _ = LowRankGGN(twin, loss_func, (inputs, targets), **options).eigh(
        top_k=K
    )
    assert torch.equal(evals, expected)  # the same computation
