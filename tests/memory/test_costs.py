"""The cost model of the Gram route's solvers (``vivit.memory.costs``;
``docs/math.rst``, "Choosing the solver"): its rules, and the work it reads off
the factors' shapes."""

import pytest
import torch

import vivit.memory.costs
from tests.fixtures.memory import available
from tests.fixtures.problems import mlp
from vivit import LowRankGGN
from vivit.gram import DenseFactors, OuterProductFactors, StackedFactors
from vivit.memory.costs import choose_solver

CPU, F32, META = torch.device("cpu"), torch.float32, torch.device("meta")


class Formed(DenseFactors):
    """Explicit columns whose Gram matrix costs nothing to form (formed before)."""

    def gram_work(self):
        return 0


def explicit(samples, columns, params):
    """Explicit columns ``[N, C, D]`` on the meta device: shapes only."""
    return [Formed(torch.empty(samples, columns, params, device=META))]


def test_choose_solver_rules(monkeypatch):
    available(monkeypatch, 2**40)
    large, small = explicit(512, 10, 10**6), explicit(20, 10, 10**6)
    # all or many eigenpairs: dense
    assert choose_solver(large, None, F32, CPU) == "dense"
    assert choose_solver(explicit(10, 10, 10**6), 50, F32, CPU) == "dense"
    # few pairs of a large Gram: iterative; of a small one: dense
    assert choose_solver(large, 10, F32, CPU) == "gram_krylov"
    assert choose_solver(small, 10, F32, CPU) == "dense"
    # a GGN smaller than its Gram matrix (D < N·C): matrix-free, unless formed
    thin = explicit(2000, 10, 1898)
    assert choose_solver(thin, 5, F32, CPU) == "factor_krylov"
    assert choose_solver(thin, 5, F32, CPU, gram_formed=True) == "gram_krylov"
    # a Gram matrix that does not fit: matrix-free
    available(monkeypatch, 2**26)
    assert choose_solver(large, 10, F32, CPU) == "factor_krylov"


def benchmark_mlp(batch_size):
    """The MLP 784-128-64-10 of ``benchmarks/`` on random data, float32 (its
    factors: the Gram route's solvers are compared)."""
    torch.manual_seed(0)
    model = mlp(784, 128, 64, 10, activation=torch.nn.ReLU)
    X, y = torch.randn(batch_size, 784), torch.randint(0, 10, (batch_size,))
    return LowRankGGN(model, torch.nn.CrossEntropyLoss(), (X, y), route="gram")


@pytest.mark.parametrize(
    "batch_size, expected", [(128, "gram_krylov"), (512, "factor_krylov")]
)
def test_choose_solver_with_factors(monkeypatch, batch_size, expected):
    """The choices measured fastest on the benchmarks' MLP: at N = 512 forming
    the 5120² Gram matrix costs more than the matrix-free solve; at N = 128 it is
    formed in the cache and its products are cheaper than ``V``-products."""
    available(monkeypatch, 2**40)
    factors = benchmark_mlp(batch_size)._group(0).ggn_factors
    assert choose_solver(factors, 10, F32, CPU) == expected
    # once the Gram matrix exists, its products are the cheaper ones
    assert choose_solver(factors, 10, F32, CPU, gram_formed=True) == "gram_krylov"


def test_choose_solver_compares_the_solves_after_forming_the_gram(monkeypatch):
    """Forming the Gram matrix, however costly, does not decide iterative vs dense."""

    class Costly(DenseFactors):
        def gram_work(self):
            return 10**15

        def product_work(self, num_vectors):
            return 10**15 * num_vectors

    available(monkeypatch, 2**40)
    large = [Costly(torch.empty(512, 10, 10**6, device=META))]
    small = [Costly(torch.empty(20, 10, 10**6, device=META))]
    assert choose_solver(large, 10, F32, CPU) == "gram_krylov"
    assert choose_solver(small, 10, F32, CPU) == "dense"


def test_v_products_pay_for_reading_the_factors(monkeypatch):
    """Per-token Monte-Carlo factors of a language model (``gpt2-4l-128-v500``
    at N = 8, R = 512, 0.7 GB of factors): counting the multiply-adds alone
    chose the matrix-free solver; the factors' memory passes decide."""
    available(monkeypatch, 2**40)

    def weight(outputs, inputs):
        return OuterProductFactors(
            torch.empty(8, 1, 64, inputs, device=META),
            torch.empty(64, 8, 1, 64, outputs, device=META),
            torch.Size([outputs, inputs]),
        )

    layer = [weight(384, 128), weight(128, 128), weight(512, 128), weight(128, 512)]
    factors = 4 * layer + [weight(500, 128)]
    assert choose_solver(factors, 10, F32, CPU) == "dense"
    monkeypatch.setattr(vivit.memory.costs, "memory_passes", lambda *args: 0.0)
    assert choose_solver(factors, 10, F32, CPU) == "factor_krylov"


def test_factor_work():
    """The work the cost model reads off the factors, from their shapes."""
    ggn = benchmark_mlp(64)
    weight = ggn._group(0).ggn_factors[0]  # Linear 784 → 128, factor form
    N, C, O, P = 64, 10, 128, 784
    assert weight.product_work(20) == 2 * 20 * (N * C * O + N * O * P)
    # the Gram matrix from products of sample pairs: (NC)²·O + N²·P + (NC)²
    assert weight.gram_work() == (N * C) ** 2 * O + N**2 * P + (N * C) ** 2
    bias = ggn._group(0).ggn_factors[1]  # explicit columns
    assert bias.product_work(20) == 2 * 20 * N * C * O
    # in two parts of the samples: the products add up; the Gram is two diagonal
    # blocks and one cross block (mirrored), 3/4 of the pairs of the whole
    halves = StackedFactors([weight.select(range(32)), weight.select(range(32, 64))])
    assert halves.product_work(20) == weight.product_work(20)
    assert halves.gram_work() == 3 * weight.gram_work() // 4
