"""The result type of every error model: :class:`Bound`, with its :class:`Explanation`.

A ``Bound`` is an elementwise bound ``|computed - exact| <= abs`` for one operator
under a stated computation model, either

* **deterministic** (worst case: never violated, for any data and any rounding
  errors allowed by the model), or
* **probabilistic** (holds for each element with probability at least
  ``1 - failure_probability`` under the model of Higham & Mary (2019): rounding
  errors are mean-independent random variables bounded by ``u``; exact for
  stochastic rounding, an excellent model of round-to-nearest on non-pathological data), or
* **statistical** (``z`` standard deviations of the error expected under an unknown
  summation order and random round-to-nearest errors, with a per-element false-alarm rate
  ``failure_probability``: :mod:`.statistical`; served by :func:`ttrace_num.tolerance`).

``abs`` is a float64 tensor broadcastable to the operator's output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

Mode = Literal["deterministic", "probabilistic", "statistical"]
#: every mode :func:`ttrace_num.tolerance` accepts
MODES = ("deterministic", "probabilistic", "statistical")
#: the modes an op's own error model takes (``"statistical"`` is built by :mod:`.statistical`)
OP_MODES = ("deterministic", "probabilistic")

#: Default per-element failure probability of probabilistic bounds. With the
#: Azuma-Hoeffding tail ``2 exp(-lambda**2 / 2)`` it gives ``lambda ~= 5.4``.
DEFAULT_FAILURE_PROBABILITY = 1e-6


def check_mode(mode: str, allowed: tuple[str, ...] = OP_MODES) -> Mode:
    """``mode`` if it is one of ``allowed`` (default: the modes of an op's own error model),
    else a ``ValueError`` saying which modes exist and where ``"statistical"`` is served."""
    if mode not in allowed:
        hint = ("; mode='statistical' is served by ttrace_num.tolerance(op, ..., mode='statistical')"
                if mode == "statistical" else "")
        raise ValueError(f"mode must be one of {allowed}, got {mode!r}{hint}")
    return mode  # type: ignore[return-value]


def lambda_for(failure_probability: float) -> float:
    """``lambda`` with ``2 exp(-lambda**2 / 2) = failure_probability`` (Azuma-Hoeffding tail)."""
    if not 0.0 < failure_probability < 1.0:
        raise ValueError(f"failure_probability must be in (0, 1), got {failure_probability}")
    return math.sqrt(2.0 * math.log(2.0 / failure_probability))


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, torch.Tensor):
        if v.numel() == 1:
            return f"{float(v):.6g}"
        return f"tensor{tuple(v.shape)} max={float(v.max()):.6g}"
    return str(v)


@dataclass(frozen=True)
class Explanation:
    """Which formula produced a bound, where it comes from, and what was plugged in.

    ``terms`` holds the explanations of sub-bounds a composite bound is built from.
    """

    op: str
    formula: str
    source: str
    assumptions: tuple[str, ...] = ()
    values: Mapping[str, Any] = field(default_factory=dict)
    terms: tuple["Explanation", ...] = ()

    def render(self, indent: int = 0) -> str:
        pad = " " * indent
        lines = [f"{pad}{self.op}: {self.formula}", f"{pad}  source: {self.source}"]
        for a in self.assumptions:
            lines.append(f"{pad}  assumes: {a}")
        if self.values:
            lines.append(pad + "  with: " + ", ".join(f"{k}={_fmt_value(v)}" for k, v in self.values.items()))
        for t in self.terms:
            lines.append(t.render(indent + 2))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "formula": self.formula,
            "source": self.source,
            "assumptions": list(self.assumptions),
            "values": {k: _fmt_value(v) for k, v in self.values.items()},
            "terms": [t.to_dict() for t in self.terms],
        }

    def __str__(self) -> str:
        return self.render()


@dataclass
class Bound:
    """Elementwise bound on ``|computed - exact|`` for one operator.

    Attributes:
        abs: float64 tensor, broadcastable to the output.
        mode: ``"deterministic"``, ``"probabilistic"`` or ``"statistical"``.
        failure_probability: per-element probability that the bound fails under the
            model (0 for deterministic bounds).
        explanation: formula, source and values; see :meth:`explain`.
        magnitude: optional float64 tensor ~ ``|exact|`` (used for relative views).
    """

    abs: torch.Tensor
    mode: Mode
    failure_probability: float
    explanation: Explanation
    magnitude: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.abs = torch.as_tensor(self.abs, dtype=torch.float64)
        if torch.isnan(self.abs).any():
            raise ValueError(f"bound for {self.explanation.op} contains NaN; the inputs probably contain NaN/Inf")

    # ----------------------------------------------------------------- views
    def explain(self) -> str:
        """Human-readable derivation: formula, source, assumptions and plugged-in values."""
        head = f"[{self.mode}" + (f", per-element failure probability <= {self.failure_probability:.3g}]"
                                  if self.mode == "probabilistic" else
                                  f", per-element false-alarm rate <= {self.failure_probability:.3g}]"
                                  if self.mode == "statistical" else "]")
        return head + "\n" + self.explanation.render()

    def max(self) -> float:
        return float(self.abs.max()) if self.abs.numel() else 0.0

    def norm(self, ord: float = 2.0) -> float:
        """Bound on ``||computed - exact||_ord`` (elementwise bound => same bound in any monotone norm).

        For a probabilistic bound the failure probability of the norm bound is at most
        ``numel * failure_probability`` (union bound)."""
        return float(torch.linalg.vector_norm(self.abs.flatten(), ord))

    def rel(self) -> torch.Tensor:
        """Relative bound ``abs / |exact|`` (inf where the magnitude is 0)."""
        if self.magnitude is None:
            raise ValueError(f"bound for {self.explanation.op} carries no magnitude; relative view unavailable")
        return self.abs / self.magnitude.abs()

    def atol_rtol(self, rtol_quantile: float = 0.5) -> tuple[float, float]:
        """A scalar ``(atol, rtol)`` pair that covers the elementwise bound everywhere.

        ``rtol`` is the ``rtol_quantile`` of ``abs/|exact|`` and ``atol`` the smallest value
        with ``abs <= atol + rtol*|exact|`` for every element, so ``torch.testing.assert_close(
        ..., atol=atol, rtol=rtol)`` accepts everything the bound accepts (and more).
        """
        if self.magnitude is None:
            return self.max(), 0.0
        mag = torch.broadcast_to(self.magnitude.abs(), torch.broadcast_shapes(self.abs.shape, self.magnitude.shape))
        b = torch.broadcast_to(self.abs, mag.shape)
        ratio = (b / mag).flatten()
        ratio = ratio[torch.isfinite(ratio)]
        rtol = float(torch.quantile(ratio, rtol_quantile)) if ratio.numel() else 0.0
        atol = float((b - rtol * mag).clamp(min=0).max()) if b.numel() else 0.0
        return atol, rtol

    def ratio(self, computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """``|computed - exact| / abs`` elementwise (> 1 means the bound is violated)."""
        err = (computed.to(torch.float64) - exact.to(torch.float64)).abs()
        return err / self.abs

    def violations(self, computed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """Boolean mask of elements where the bound is violated."""
        err = (computed.to(torch.float64) - exact.to(torch.float64)).abs()
        return err > self.abs

    # ----------------------------------------------------------- composition
    def __add__(self, other: "Bound") -> "Bound":
        """Triangle inequality: the sum of two error bounds bounds the sum of the errors."""
        mode: Mode = next((m for m in ("statistical", "probabilistic") if m in (self.mode, other.mode)),
                          "deterministic")
        return Bound(
            abs=self.abs + other.abs,
            mode=mode,
            failure_probability=min(1.0, self.failure_probability + other.failure_probability),
            explanation=Explanation(op=f"{self.explanation.op} + {other.explanation.op}",
                                    formula="b1 + b2 (triangle inequality; failure probabilities add)",
                                    source="triangle inequality, union bound",
                                    terms=(self.explanation, other.explanation)),
            magnitude=self.magnitude if self.magnitude is not None else other.magnitude,
        )

    def scaled(self, factor: float, reason: str) -> "Bound":
        """The bound times a stated safety factor (the reason is kept in the explanation)."""
        return Bound(abs=self.abs * factor, mode=self.mode, failure_probability=self.failure_probability,
                     explanation=Explanation(op=self.explanation.op, formula=f"{factor:g} * bound",
                                             source=reason, terms=(self.explanation,)),
                     magnitude=self.magnitude)
