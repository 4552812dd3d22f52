"""Leading GGN eigenpairs of a data set whose layer factors do not fit into memory.

:class:`~vivit.LowRankGGN` over a data loader keeps every batch's layer factors
(one pass). :class:`StreamingGGN` keeps none: each product with the Gram matrix
recomputes them in two passes over the loader (:mod:`vivit.sources.streamed`,
``docs/math.rst``, "Data sets and processes"); every result is the same as
:class:`~vivit.LowRankGGN`'s, computed by the same code (:mod:`vivit.results`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from vivit._validation import check_grad_mode
from vivit.engines.base import Engine, OutputSelector
from vivit.errors import InvalidArgumentError
from vivit.options import CurvatureOptions, check_streaming
from vivit.results import CurvatureResults
from vivit.sources.streamed import StreamedFactors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class StreamingGGN(CurvatureResults):
    """Leading GGN eigenpairs of a data set, recomputing the factors per product.

    The GGN is that of the loss on all samples of the loader together, as for
    :class:`~vivit.LowRankGGN` over a loader, which stores every batch's layer
    factors in one pass; when they do not fit, this class stores none. The
    construction makes one pass (loss, gradient, each batch's normalization);
    :meth:`eigh` then makes two passes per product with the Gram matrix and one
    more for the eigenvectors (``docs/math.rst``, "Data sets and processes");
    :meth:`directional_derivatives` one more for ``γ`` (per-sample gradients
    against the eigenvectors), :meth:`newton` one more for the step, and every
    product of :meth:`operator` one or two. The leading eigenpairs and their
    eigenvectors are kept per group, solver, tolerance and seed.

    It takes the options of :class:`~vivit.LowRankGGN`
    (:class:`~vivit.options.CurvatureOptions`) and answers its methods, with
    what needs the whole Gram matrix refused by name: :meth:`gram`,
    :meth:`eigvalsh`, :meth:`zero_tolerance`, ``top_k=None`` and the solvers
    ``"dense"`` and ``"gram_krylov"`` (:class:`~vivit.InvalidArgumentError`).

    The loader must be re-iterable and yield the same batches every time
    (``DataLoader(..., shuffle=False)``, no random augmentation): this is
    checked batch by batch. Every pass starts from the random state at
    construction, so Dropout in training mode draws the first pass's masks in
    every pass, whatever the caller draws in between. The model must not change
    either: a pass after its parameters or buffers changed raises
    :class:`~vivit.ModelChangedError`.

    Example::

        loader = DataLoader(TensorDataset(X, y), batch_size=256)
        ggn = StreamingGGN(model, CrossEntropyLoss(), loader)
        evals, evecs = ggn.eigh(top_k=10)
        print(ggn.passes, "passes over the data")

    Args:
        model: As for :class:`~vivit.LowRankGGN`.
        loss_func: As for :class:`~vivit.LowRankGGN`.
        data: A re-iterable loader of ``(inputs, targets)`` batches (a list of
            batches, a ``DataLoader``), or one batch; not an iterator or
            generator.
        param_groups: As for :class:`~vivit.LowRankGGN`.
        mc_samples: As for :class:`~vivit.options.CurvatureOptions`; block ``b`` draws
            the same samples in every pass (and the same as ``LowRankGGN`` over the
            loader with the same ``generator`` and ``chunk_size``).
        mc_per: As for :class:`~vivit.options.CurvatureOptions`.
        subsampling: Refused (a stream covers every sample of its loader: pass
            a loader over the samples whose curvature you want).
        generator: As for :class:`~vivit.options.CurvatureOptions`.
        gram_dtype: As for :class:`~vivit.options.CurvatureOptions`: type of every
            product.
        solver: ``"auto"`` or ``"factor_krylov"``: block Krylov on the products
            (recomputed by passes over the data).
        solver_tol: As for :class:`~vivit.options.CurvatureOptions`.
        solver_seed: As for :class:`~vivit.options.CurvatureOptions`.
        engine: As for :class:`~vivit.options.CurvatureOptions`.
        progress: As for :class:`~vivit.options.CurvatureOptions`: the bar of every
            pass.
        process_group: ``False`` (default) or ``None`` without an initialised
            ``torch.distributed``: each process streams over its own loader
            alone. A process group (the union of the ranks' loaders) is refused.
        chunk_size: As for :class:`~vivit.options.CurvatureOptions`: every batch of
            every pass runs in chunks of at most this many samples.
        output: As for :class:`~vivit.options.CurvatureOptions`.
        max_batches: As for :class:`~vivit.options.CurvatureOptions`: every pass reads
            the first ``max_batches`` batches of the loader (which must yield the same
            ones each time).

    Attributes:
        loss: The loss on all samples (detached).
        param_groups: The parameter groups.
        engine: Name of the engine.

    Raises:
        VivitError: As :class:`~vivit.LowRankGGN` for malformed arguments or
            batches; :class:`~vivit.InvalidArgumentError` for an iterator, the
            solver ``"dense"`` or ``"gram_krylov"``, a subsampling or a process
            group (before the first pass).
    """

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: Iterable[tuple[Tensor, Tensor]],
        *,
        param_groups: Sequence[Sequence[Parameter]] | None = None,
        mc_samples: int = 0,
        mc_per: str = "token",
        subsampling: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        gram_dtype: torch.dtype | None = None,
        solver: str = "auto",
        solver_tol: float | None = None,
        solver_seed: int = 0,
        engine: str | Engine = "auto",
        progress: bool | None = None,
        process_group: ProcessGroup | bool | None = False,
        chunk_size: int | None = None,
        output: OutputSelector = None,
        max_batches: int | None = None,
    ):
        check_grad_mode("StreamingGGN")
        options = CurvatureOptions(
            mc_samples=mc_samples,
            mc_per=mc_per,
            subsampling=subsampling,
            generator=generator,
            gram_dtype=gram_dtype,
            solver=solver,
            solver_tol=solver_tol,
            solver_seed=solver_seed,
            engine=engine,
            progress=progress,
            process_group=process_group,
            chunk_size=chunk_size,
            output=output,
            max_batches=max_batches,
        )
        check_streaming(options)
        self._stream = StreamedFactors(model, loss_func, data, param_groups, options)
        super().__init__(self._stream, options)

    @property
    def passes(self) -> int:
        """Passes over the data made so far."""
        return self._stream.passes

    @property
    def num_rows(self) -> int:
        """Side length ``N·C`` (``N·M`` with MC) of the Gram matrix, all batches."""
        return self._stream.num_rows

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
        source = self._stream.group(group)
        if (
            not isinstance(vectors, Tensor)
            or vectors.dim() != 2
            or vectors.shape[0] != self.num_rows
            or vectors.dtype != source.dtype
            or vectors.device != source.device
        ):
            got = (
                f"{tuple(vectors.shape)} {vectors.dtype} on {vectors.device}"
                if isinstance(vectors, Tensor)
                else type(vectors).__name__
            )
            raise InvalidArgumentError(
                f"vectors must be a [{self.num_rows}, K] tensor (N·C rows, one "
                f"column per vector) of {source.dtype} on {source.device}, got {got}."
            )
        return source.products.gram_matmul(vectors)
