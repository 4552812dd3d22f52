"""Analyses built on the front doors: how the GGN and its approximations behave.

- :func:`audit_approximations`: which approximation of the GGN (Monte-Carlo,
  subsampled, block-diagonal, diagonal, KFAC, EKFAC) recovers the exact top-k
  eigenpairs and damped Newton step of a mini-batch, as an
  :class:`ApproximationAudit` table.
"""

from vivit.analysis.audit import (
    APPROXIMATIONS,
    ApproximationAudit,
    AuditRow,
    audit_approximations,
)

__all__ = ["APPROXIMATIONS", "ApproximationAudit", "AuditRow", "audit_approximations"]
