"""Leading GGN eigenpairs of a data set whose layer factors do not fit into memory.

Directional derivatives and damped Newton steps along them come with one more
pass each.

:class:`~vivit.LowRankGGN` over a data loader keeps every batch's layer factors
(one pass). :class:`StreamingGGN` keeps none: each product with the Gram matrix
recomputes every batch's factors (``docs/math.rst``, "Data sets and
processes")::

    G̃ U = concat_b V_bᵀ W,   W = Σ_b' V_b' U_b'

two passes over the loader per product (the first accumulates ``W`` in parameter
space, the second maps it back batch by batch), with the block Krylov solver of
:mod:`vivit.linalg.iterative`. Memory: one batch's factors, ``W`` and the Krylov
basis (``N·C × m``). Every pass must see the same batches: each batch's inputs
and targets are fingerprinted in the first pass and checked in every later one
(:class:`BatchFingerprints`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import (
    check_batch,
    check_damping,
    check_generator,
    check_grad_mode,
    check_group_index,
    check_lr,
    check_max_decrease,
    check_mc_samples,
    check_model,
    check_params,
    param_group_lists,
)
from vivit.directional.gram_space import (
    Damping,
    batch_directional_gradient,
    directional_curvatures,
    newton_coefficients_damped,
)
from vivit.directional.results import DirectionalDerivatives, NewtonStep
from vivit.engines.base import CurvatureRequest, Engine
from vivit.engines.choice import check_engine, resolve_engine
from vivit.errors import (
    InvalidArgumentError,
    ModelChangedError,
    NondeterministicDataError,
)
from vivit.gram import ParamFactors
from vivit.linalg.group_products import v_matmul, vt_matmul
from vivit.linalg.iterative import (
    SolverReport,
    block_krylov_eigh,
    check_seed,
    check_tolerance,
)
from vivit.linalg.solvers import (
    check_gram_dtype,
    check_top_k,
    direction_coefficients,
    top_k_indices,
)
from vivit.losses import check_loss_function
from vivit.sources.batches import (
    RandomState,
    check_progress,
    engine_context,
    is_batch,
    iterate_batches,
    naming_batch,
    num_batches,
    progress_bar,
    run_block,
)
from vivit.sources.blocks import UnionOutput, block_requests, block_scale, union_batch


def fingerprint(batch: Sequence[Tensor]) -> str:
    """A digest of tensors: shapes, types and every byte.

    Args:
        batch: The tensors, e.g. ``(inputs, targets)``.

    Returns:
        The hexadecimal BLAKE2b digest.
    """
    digest = hashlib.blake2b(digest_size=16)
    for tensor in batch:
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype};".encode())
        data = tensor.detach().contiguous().cpu().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model: Module) -> str:
    """A digest of the model's parameters and buffers (:func:`fingerprint`).

    Args:
        model: The model.

    Returns:
        The hexadecimal digest.
    """
    state = model.state_dict()
    return fingerprint([value for value in state.values() if isinstance(value, Tensor)])


class BatchFingerprints:
    """Checks that every pass over a loader yields the same batches.

    The first pass records each batch's :func:`fingerprint`; later passes must
    yield batches with the same fingerprints, and as many.
    """

    def __init__(self) -> None:
        self._first: list[str] = []
        self._pass = 0

    def check(self, batches: Iterable[tuple[Tensor, Tensor]]) -> Iterator:
        """The batches of one pass, each checked against the first pass.

        Args:
            batches: The pass's batches.

        Yields:
            The batches, unchanged.

        Raises:
            NondeterministicDataError: If a batch differs from the same batch of
                the first pass, or the pass has another number of batches.
        """
        self._pass += 1
        count = 0
        for index, batch in enumerate(batches):
            digest = fingerprint(batch)
            if self._pass == 1:
                self._first.append(digest)
            elif index >= len(self._first) or digest != self._first[index]:
                raise NondeterministicDataError(
                    f"Batch {index} of the data loader differs between pass 1 and "
                    f"pass {self._pass}"
                    + (
                        f" (pass 1 had only {len(self._first)} batches)"
                        if index >= len(self._first)
                        else ""
                    )
                    + ": streaming combines every batch of every pass, so the "
                    "loader must yield the same batches in the same order each "
                    "time. Use DataLoader(..., shuffle=False) without random "
                    "transforms (or a fixed list of batches)."
                )
            count += 1
            yield batch
        if self._pass > 1 and count != len(self._first):
            raise NondeterministicDataError(
                f"The data loader yielded {count} batches in pass {self._pass} but "
                f"{len(self._first)} in pass 1; streaming needs the same batches "
                "in every pass."
            )


class StreamingGGN:
    """Leading GGN eigenpairs of a data set, recomputing the factors per product.

    The GGN is that of the loss on all samples of the loader together, as for
    :class:`~vivit.LowRankGGN` over a loader, which stores every batch's layer
    factors in one pass; when they do not fit, this class stores none. The
    construction makes one pass (loss, gradient, each batch's normalization);
    :meth:`eigh` then makes two passes per product with the Gram matrix and one
    more for the eigenvectors (``docs/math.rst``, "Data sets and processes");
    :meth:`directional_derivatives` one more for ``γ`` (per-sample gradients
    against the eigenvectors), :meth:`newton` one more for the step. The
    eigenpairs of the latest request per group are kept.
    The loader must be re-iterable and yield the same batches every time
    (``DataLoader(..., shuffle=False)``, no random augmentation): this is
    checked batch by batch. Every pass starts from the random state at
    construction, so Dropout in training mode draws the first pass's masks in
    every pass, whatever the caller draws in between. The model must not change
    either: a pass after its parameters or buffers changed raises
    :class:`~vivit.ModelChangedError`. One process's loader:
    under ``torch.distributed`` each rank streams over its own loader alone (no
    union of the ranks).

    Example::

        loader = DataLoader(TensorDataset(X, y), batch_size=256)
        ggn = StreamingGGN(model, CrossEntropyLoss(), loader)
        evals, evecs = ggn.eigh(top_k=10)
        print(ggn.passes, "passes over the data")

    Args:
        model: As for :class:`~vivit.LowRankGGN`.
        loss_func: As for :class:`~vivit.LowRankGGN`.
        data: A re-iterable loader of ``(inputs, targets)`` batches (a list of
            batches, a ``DataLoader``); not an iterator or generator.
        param_groups: As for :class:`~vivit.LowRankGGN`.
        mc_samples: As for :class:`~vivit.LowRankGGN`; batch ``b`` draws the same
            samples in every pass (and the same as ``LowRankGGN`` over the loader
            with the same ``generator``).
        generator: As for :class:`~vivit.LowRankGGN`.
        gram_dtype: As for :class:`~vivit.LowRankGGN`: type of every product.
        engine: As for :class:`~vivit.LowRankGGN`.
        progress: Progress bar of every pass, as for :class:`~vivit.LowRankGGN`.

    Attributes:
        loss: The loss on all samples (detached).
        param_groups: The parameter groups.
        engine: Name of the engine.
        passes: Passes over the data made so far.

    Raises:
        VivitError: As :class:`~vivit.LowRankGGN` for malformed arguments or
            batches; :class:`~vivit.InvalidArgumentError` for an iterator.
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: Iterable[tuple[Tensor, Tensor]],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        engine: str | Engine = "auto",
        progress: bool | None = None,
    ):
        check_grad_mode("StreamingGGN")
        check_model(model)
        check_loss_function(loss_func)
        if is_batch(data):
            data = [check_batch(data)]
        elif isinstance(data, Iterator):
            raise InvalidArgumentError(
                "StreamingGGN passes over the data many times, but an iterator or "
                f"generator ({type(data).__name__}) can be passed over once: pass "
                "a list of batches or a DataLoader."
            )
        self.param_groups = param_group_lists(param_groups, model)
        names = {id(p): f"parameter {n!r}" for n, p in model.named_parameters()}
        check_params([p for group in self.param_groups for p in group], names)
        check_gram_dtype(gram_dtype)
        check_mc_samples(mc_samples)
        check_generator(generator)
        check_engine(engine)
        check_progress(progress)
        chosen = resolve_engine(engine, model, loss_func)
        self.engine = chosen.name
        self.passes = 0
        self._model, self._data, self._progress = model, data, progress
        self._gram_dtype = gram_dtype
        self._fingerprints = BatchFingerprints()
        self._reports: dict[int, SolverReport] = {}
        self._leading: dict[int, tuple[tuple, Tensor, Tensor, list[Tensor]]] = {}
        request = CurvatureRequest(
            param_groups=self.param_groups,
            mc_samples=mc_samples,
            generator=generator,
            compute_gradients=False,
            num_grams=0,
            gram_dtype=gram_dtype,
        )
        requests = block_requests(request)

        def runner(index: int, batch: tuple[Tensor, Tensor], gradients: bool):
            block_request = dataclasses.replace(
                requests(index), compute_gradients=gradients
            )
            return lambda sink: chosen.run(model, loss_func, batch, block_request, sink)

        self._runner = runner
        # every pass draws what the first did (Dropout masks in training mode)
        self._random_start = RandomState.capture(self.param_groups)
        self._model_state = model_fingerprint(model)
        self._first_pass()

    # Passes over the data ------------------------------------------------------
    def _pass(self, visit: Callable, description: str, gradients: bool = False) -> None:
        """One pass: runs the engine on every batch and hands its result on.

        With ``gradients`` the blocks keep their per-sample-gradient factors.

        Raises:
            GradientContextError: Inside ``torch.inference_mode()`` (every method
                that passes over the data runs a backward pass).
        """
        check_grad_mode("StreamingGGN")
        self._check_model_unchanged()
        self.passes += 1
        batches = self._fingerprints.check(iterate_batches(self._data, self._model))
        batches = progress_bar(
            batches,
            num_batches(self._data),
            self._progress,
            f"StreamingGGN: pass {self.passes} ({description})",
        )
        with engine_context(self.param_groups, self._random_start):
            for index, batch in enumerate(batches):
                with naming_batch(index):
                    block = run_block(
                        self._runner(index, batch, gradients),
                        self.param_groups,
                        self._gram_dtype,
                        keep_gradient_factors=gradients,
                    )
                visit(index, block)

    def _check_model_unchanged(self) -> None:
        """Refuse a pass with other parameter or buffer values than the first.

        Raises:
            ModelChangedError: If the model's state differs from construction.
        """
        if model_fingerprint(self._model) != self._model_state:
            raise ModelChangedError(
                f"The model's parameters or buffers changed since this StreamingGGN "
                f"was built (before pass {self.passes + 1}): its loss, gradient and "
                "normalization belong to the old values, and a pass with the new "
                "ones would mix two models. Build a new StreamingGGN after changing "
                "the model (LowRankGGN keeps the factors of its construction)."
            )

    def _first_pass(self) -> None:
        union = UnionOutput()
        self._rows: list[int] = []
        self._factor_dtypes: list[torch.dtype] = []

        def visit(index, block):
            union.add(block.curvature[0].batch, block.output)
            self._rows.append(block.curvature[0].ggn_factors[0].num_rows)
            if index == 0:
                self._factor_dtypes = [c.factor_dtype for c in block.curvature]
                self._dtypes = [c.ggn_factors[0].dtype for c in block.curvature]

        self._pass(visit, "loss and gradient")
        self.loss, gradients = union.result()
        gradients = iter(gradients)
        self._gradients = [[next(gradients) for _ in g] for g in self.param_groups]
        self._union = union_batch(union.batches)
        self._scales = [
            block_scale(self._union.ggn_reduction_factor, batch.ggn_reduction_factor)
            for batch in union.batches
        ]
        self._bounds = [0]
        for rows in self._rows:
            self._bounds.append(self._bounds[-1] + rows)

    def _factors_pass(
        self, group: int, visit: Callable[[int, list[ParamFactors]], None], what: str
    ) -> None:
        """A pass handing every batch's factors of ``group`` (rescaled) to ``visit``."""

        def visit_block(index, block):
            scale = self._scales[index]
            visit(index, [f.scaled(scale) for f in block.curvature[group].ggn_factors])

        self._pass(visit_block, what)

    def _v_products(self, group: int, coefficients: Tensor, what: str) -> list[Tensor]:
        """``V u = Σ_b V_b u_b`` for Gram-space rows ``[K, N·C]``: one pass."""
        result: list[Tensor] = []

        def visit(index, factors):
            rows = coefficients[:, self._bounds[index] : self._bounds[index + 1]]
            products = v_matmul(factors, rows)
            if not result:
                result.extend(products)
            else:
                for total, product in zip(result, products, strict=True):
                    total.add_(product)

        self._factors_pass(group, visit, what)
        return result

    def _vt_products(self, group: int, vectors: list[Tensor], what: str) -> Tensor:
        """``Vᵀ W`` (rows ``[K, N·C]``) for parameter-space vectors: one pass."""
        blocks: list[Tensor] = []
        self._factors_pass(
            group,
            lambda index, factors: blocks.append(vt_matmul(factors, vectors)),
            what,
        )
        return torch.cat(blocks, dim=1)

    def gram_matmul(self, vectors: Tensor, group: int = 0) -> Tensor:
        """``G̃ U = Vᵀ (V U)`` of a group, by two passes over the data.

        Args:
            vectors: ``U``, Gram-space vectors as columns, ``[N·C, K]`` (rows
                ordered batch by batch, each sample-major, as
                :meth:`vivit.LowRankGGN.gram`).
            group: Index of the parameter group.

        Returns:
            ``[N·C, K]``.

        Raises:
            InvalidArgumentError: If ``vectors`` is not a ``[N·C, K]`` tensor of
                the group's Gram-space type and device.
            GroupIndexError: If there is no such group.
        """
        check_group_index(group, len(self.param_groups))
        dtype, device = self._dtypes[group], self._gradients[group][0].device
        if (
            not isinstance(vectors, Tensor)
            or vectors.dim() != 2
            or vectors.shape[0] != self.num_rows
            or vectors.dtype != dtype
            or vectors.device != device
        ):
            got = (
                f"{tuple(vectors.shape)} {vectors.dtype} on {vectors.device}"
                if isinstance(vectors, Tensor)
                else type(vectors).__name__
            )
            raise InvalidArgumentError(
                f"vectors must be a [{self.num_rows}, K] tensor (N·C rows, one "
                f"column per vector) of {dtype} on {device}, got {got}."
            )
        rows = vectors.T.contiguous()
        products = self._v_products(group, rows, "V·U")
        return self._vt_products(group, products, "Vᵀ·(V·U)").T

    # Results -------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Side length ``N·C`` (``N·M`` with MC) of the Gram matrix, all batches."""
        return self._bounds[-1]

    def gradient(self, group: int = 0) -> list[Tensor]:
        """The gradient of the loss on all samples.

        Args:
            group: Index of the parameter group.

        Returns:
            One tensor per parameter of the group.
        """
        check_group_index(group, len(self.param_groups))
        return self._gradients[group]

    def eigh(
        self,
        top_k: int,
        group: int = 0,
        *,
        tol: float | None = None,
        seed: int = 0,
    ) -> tuple[Tensor, list[Tensor]]:
        """The ``top_k`` leading eigenpairs of the GGN, by block Krylov iteration.

        Args:
            top_k: Number of leading eigenpairs (numerically zero ones are left
                out, as by :meth:`vivit.LowRankGGN.eigh`).
            group: Index of the parameter group.
            tol: Relative residual bound ``‖G̃ũ − λũ‖ ≤ tol·λ_max`` (default
                ``max(100·ε, 1e-12)`` of the products' type).
            seed: Seed of the random start block.

        Returns:
            Eigenvalues ``[K]`` ascending (in ``gram_dtype``), eigenvectors as one
            tensor ``[K, *p.shape]`` per parameter (in its dtype).

        Raises:
            SolverNotConvergedError: If the iteration does not converge.
        """
        evals, _, evecs = self._directions(top_k, group, tol, seed)
        params = self.param_groups[group]
        return evals, [e.to(p.dtype) for e, p in zip(evecs, params, strict=True)]

    def _directions(
        self, top_k: int, group: int, tol: float | None, seed: int
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Eigenvalues, Gram eigenvectors and eigenvectors (in ``gram_dtype``).

        Cached per group for the latest ``(top_k, tol, seed)``.
        """
        check_top_k(top_k)
        if top_k is None:
            raise InvalidArgumentError(
                "StreamingGGN computes a few leading eigenpairs: pass top_k."
            )
        check_group_index(group, len(self.param_groups))
        check_tolerance(tol)
        check_seed(seed)
        key = (top_k, tol, seed)
        cached = self._leading.get(group)
        if cached is not None and cached[0] == key:
            return cached[1:]
        device = self.param_groups[group][0].device
        evals, gram_evecs, report = block_krylov_eigh(
            lambda vectors: self.gram_matmul(vectors, group),
            self.num_rows,
            top_k,
            dtype=self._dtypes[group],
            device=device,
            tol=tol,
            seed=seed,
        )
        self._reports[group] = dataclasses.replace(
            report, solver="streaming", requested="streaming"
        )
        # without the Gram matrix, tr(G̃) is bounded by N·C·λ_max
        keep = top_k_indices(evals, top_k, self.num_rows, self._factor_dtypes[group])
        evals, gram_evecs = evals[keep], gram_evecs[:, keep]
        if keep:
            coefficients = direction_coefficients(gram_evecs, evals).T.contiguous()
            evecs = self._v_products(group, coefficients, "eigenvectors")
        else:  # no direction: no pass
            evecs = [evals.new_zeros(0, *p.shape) for p in self.param_groups[group]]
        self._leading[group] = (key, evals, gram_evecs, evecs)
        return evals, gram_evecs, evecs

    def directional_derivatives(
        self,
        top_k: int,
        group: int = 0,
        *,
        tol: float | None = None,
        seed: int = 0,
    ) -> DirectionalDerivatives:
        """Per-sample first and second derivatives along the leading eigenvectors.

        ``γ_nk = e_kᵀ∇ℓ_n`` from one more pass (each batch's per-sample
        gradients against the eigenvectors); ``λ_nk`` and ``γ̄_k`` from the Gram
        eigenvectors, as :meth:`vivit.LowRankGGN.directional_derivatives` has
        them for all samples (``docs/math.rst``, "Directional derivatives and
        curvature noise").

        Args:
            top_k: Number of leading directions.
            group: Index of the parameter group.
            tol: As for :meth:`eigh`.
            seed: As for :meth:`eigh`.

        Returns:
            ``γ [N, K]``, ``λ [N, K]`` and their statistics, ``N`` the samples of
            all batches in loader order.
        """
        evals, gram_evecs, evecs = self._directions(top_k, group, tol, seed)
        blocks: list[Tensor] = []

        def visit(index, block):
            grads = block.curvature[group].grad_factors
            blocks.append(vt_matmul(grads, evecs))

        if evals.numel() > 0:
            self._pass(visit, "directional gradients", gradients=True)
            gammas = torch.cat(blocks, dim=1).T
        else:
            gammas = evals.new_zeros(self._union.batch_size, 0)
        return DirectionalDerivatives(
            evals=evals,
            gammas=gammas,
            lambdas=directional_curvatures(gram_evecs, evals, self._union),
            gamma_bar=batch_directional_gradient(gammas, self._union),
        )

    def newton(
        self,
        top_k: int,
        group: int = 0,
        damping: float | Damping = 1.0,
        *,
        lr: float = 1.0,
        max_decrease: float | None = None,
        tol: float | None = None,
        seed: int = 0,
    ) -> NewtonStep:
        """The directionally damped Newton step on the leading eigenspace.

        As :meth:`vivit.LowRankGGN.newton` on all samples of the loader; one more
        pass for the step ``V u``.

        Args:
            top_k: Number of leading directions.
            group: Index of the parameter group.
            damping: A constant ``δ ≥ 0`` or a rule (see :mod:`vivit.optim.damping`).
            lr: Scale of the returned step.
            max_decrease: As for :meth:`vivit.LowRankGGN.newton`.
            tol: As for :meth:`eigh`.
            seed: As for :meth:`eigh`.

        Returns:
            The step, the directional derivatives and the dampings used.

        Raises:
            InvalidArgumentError: As for :meth:`vivit.LowRankGGN.newton`, before
                any pass over the data.
        """
        check_damping(damping)
        check_lr(lr)
        check_max_decrease(max_decrease)
        _, gram_evecs, _ = self._directions(top_k, group, tol, seed)
        directional = self.directional_derivatives(top_k, group, tol=tol, seed=seed)
        dampings, u = newton_coefficients_damped(
            gram_evecs, directional, damping, lr=lr, max_decrease=max_decrease
        )
        params = self.param_groups[group]
        if directional.evals.numel() > 0:
            step = self._v_products(group, u.unsqueeze(0), "Newton step")
            step = [s.squeeze(0) for s in step]
        else:
            step = [torch.zeros_like(p) for p in params]
        step = [s.to(p.dtype) for s, p in zip(step, params, strict=True)]
        return NewtonStep(directional=directional, dampings=dampings, step=step)

    def solver_report(self, group: int = 0) -> SolverReport | None:
        """How the group's latest eigenpairs were computed (``None`` before).

        Args:
            group: Index of the parameter group.

        Returns:
            The Krylov solver's report: residual, cycles, products.
        """
        check_group_index(group, len(self.param_groups))
        return self._reports.get(group)
