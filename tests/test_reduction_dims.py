"""``tolerance("sum"/"mean", x, dim=..., keepdim=...)`` takes torch's signature: ``dim=None``
(the default, every dim), an int, a tuple or list of ints; checked against the exact
reduction (``exact_sum`` / ``mean_ref`` of the reduced dims flattened: fsum semantics) of
torch's own CPU result on random and adversarial data."""
import math

import pytest
import torch

import ttrace_num as tn
from ttrace_num.reference.dot import exact_sum
from ttrace_num.reference.ops import mean_ref

DIMS = [None, (), 0, -1, (0, 2), [2, 0], (0, 1, 2), (-1, 1)]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _data(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    shape = (6, 40, 33)
    if kind == "normal":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    elif kind == "cancel":  # x and -x (1 + small): |sum| << sum |x| over every set of dims
        h = torch.randn(6, 40, 33, generator=g, dtype=torch.float64)
        x = torch.where(torch.arange(33) % 2 == 0, h, -h.roll(1, -1) * (1 + 2.0 ** -7 * torch.randn(shape, generator=g)))
    elif kind == "wide":  # log-normal-scaled: magnitudes over ~30 binades
        x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(shape, generator=g))
        x = x / x.abs().max() * (1e3 if dtype == torch.float16 else 1e6)
    elif kind == "peaked":  # one large term, the rest near its rounding error
        x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** -9
        x[0, 0, 0] = 100.0
    else:
        raise ValueError(kind)
    return x.to(dtype)


def _exact(op: str, x: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    """The exact ``torch.<op>(x, dim, keepdim)``: the reduced dims moved last and flattened."""
    dims = tuple(range(x.dim())) if dim is None or dim == () else tuple(
        d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim))
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*kept, *dims).reshape(*(x.shape[d] for d in kept), -1)
    y = exact_sum(rows, -1) if op == "sum" else mean_ref(rows, -1)
    return y.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())]) if keepdim else y


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("kind", ["normal", "cancel", "wide", "peaked"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_bound_has_torchs_shape_and_holds_for_every_dim(op, kind, fmt):
    g = torch.Generator().manual_seed(hash((op, kind, fmt)) % 2**31)
    x = _data(kind, DT[fmt], g)
    fn = getattr(torch, op)
    for dim in DIMS:
        for keepdim in (False, True):
            y = fn(x) if dim is None and not keepdim else fn(x, dim=dim, keepdim=keepdim)
            b = tn.tolerance(op, x, dim=dim, keepdim=keepdim)
            assert b.abs.shape == y.shape, (dim, keepdim)
            err = (y.double() - _exact(op, x, dim, keepdim)).abs()
            assert (err <= b.abs).all(), (dim, keepdim, float((err / b.abs).max()))


@pytest.mark.parametrize("mode", ["deterministic", "probabilistic", "statistical"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_default_is_torchs_every_dim(op, mode):
    x = torch.randn(8, 16, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    b = tn.tolerance(op, x, mode=mode)
    assert b.abs.shape == getattr(torch, op)(x).shape == ()
    assert torch.equal(b.abs, tn.tolerance(op, x, dim=(0, 1, 2), mode=mode).abs)
    assert torch.equal(b.abs, tn.tolerance(op, x.flatten(), dim=0, mode=mode).abs)  # one sum of all 512 terms
    c = torch.ones(8, 16).bfloat16()  # repeated addends: the probabilistic modes' validity check, same shape
    assert tn.tolerance(op, c, mode=mode).abs.shape == ()


def test_a_scalar_and_an_empty_reduction():
    assert tn.tolerance("sum", torch.tensor(2.0)).abs.shape == ()
    assert tn.tolerance("sum", torch.zeros(0, 3), dim=0).abs.shape == (3,)
    with pytest.raises(ValueError, match="empty dimension"):
        tn.tolerance("mean", torch.zeros(0, 3), dim=0)


@pytest.mark.parametrize("dim,err,match", [((0, 0), ValueError, "twice"), (3, ValueError, "out of range"),
                                           (1.5, TypeError, "dim must be None, an int or a tuple"),
                                           ((0, "a"), TypeError, "dim must be")])
def test_bad_dim_is_named(dim, err, match):
    with pytest.raises(err, match=match):
        tn.tolerance("sum", torch.ones(2, 3, 4), dim=dim)


def test_layer_shadow_takes_every_dim():
    """``torch.sum(x)`` / ``x.mean((0, 2))`` inside a module are modelled (they were refused)."""
    from ttrace_num.propagate import layer_tolerance

    class M(torch.nn.Module):
        def forward(self, x):
            return x.sum() + x.mean((0, 2)).sum()

    x = torch.randn(4, 8, 16).bfloat16()
    lb = layer_tolerance(M(), x, against_exact=True, mode="deterministic")
    assert lb.bound.shape == () and math.isfinite(float(lb.bound)) and float(lb.bound) > 0
