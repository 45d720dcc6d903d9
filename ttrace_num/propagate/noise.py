r"""Empirical propagation: inject noise of each op's local-bound size, measure its effect.

The analytic shadow (:mod:`.shadow`) composes bounds op by op. TTrace's empirical
alternative (arXiv 2506.09280, §4) runs the trusted computation again with every op's
output perturbed by a random error as large as that op may legitimately commit, and
measures how far every tensor moves. This captures how differences really propagate
(cancellations, saturations, the actual conditioning of the data) at the cost of one
extra run per sample, and it covers gradients without a backward model per op.

:class:`NoiseInjector` (a ``TorchFunctionMode``) perturbs, for every call recognised by
:func:`~.calls.classify`:

* the forward output by ``U * b`` with ``U ~ Uniform[-1, 1]`` elementwise and ``b`` the op's
  local bound (:class:`~.local.LocalBounds`), then rounds back to the output dtype;
* in backward, the gradient flowing to each differentiable input by ``U * b_grad``:
  for ``linear``/``matmul`` ``b_grad`` is the local bound of the gradient product
  (``g W`` for the input, ``g^T x`` for the weight: the same model as a forward GEMM, so the
  policy's split-reduction difference when there is one; the sum bound for the bias); for the
  other ops it is one rounding of the gradient (``half_ulp`` of its magnitude, twice for a
  two-run difference), the error of a result computed in fp32 and stored once, which is
  how CPU kernels compute the backward of elementwise ops, norms and softmax in bf16.

Ops with a backward model of their own get it instead of one rounding (twice for two runs):
``F.scaled_dot_product_attention`` (forward: the ``attention`` bound of torch's CPU kernel,
:func:`~ttrace_num.bounds.attention.torch_cpu_sdpa_model`; backward: dQ, dK, dV of
:func:`~ttrace_num.bounds.attention.attention_backward` for that kernel),
``F.cross_entropy`` (``cross_entropy_backward`` given the scalar upstream gradient),
``F.mse_loss`` (:mod:`ttrace_num.bounds.losses`). ``F.embedding`` is exact in forward (a
gather) and its weight gradient, per row a sum of the output gradients of that row's tokens,
gets the recursive-summation bound of those terms (:meth:`NoiseInjector._embedding_grad_fn`).

Every call is counted in the injector's census (:meth:`NoiseInjector.census`,
:mod:`.census`): perturbed, exact, unmodelled (an op that can round and has no model: not
perturbed, reported), optimizer (such an op inside :meth:`NoiseInjector.optimizer_step`) or
accepted (named by the caller).

:func:`measure_propagation` runs a user function clean once and noisy ``samples`` times
and returns, per named tensor, the largest deviation seen.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch
from torch.overrides import TorchFunctionMode

import ttrace_num as tn
from ..bounds.summation import Summation
from ..bounds.summation_variance import (chain_split_difference, gemm_difference_variance, matmul_sum_statistics,
                                        may_stagnate)
from ..formats import NARROW_DTYPES, get_format, half_ulp
from .calls import OpCall, classify
from .census import Census, op_name, unclassified_category
from .local import LocalBounds, ModelPolicy
from .layout import IDENTICAL, LayoutRule, gemm_computation
from .memo import AmplitudeMemo

if TYPE_CHECKING:
    from ..calibrate import Calibration

__all__ = ["NoiseInjector", "measure_propagation", "Propagation", "perturb_custom_backward"]


class _Slot:
    g: torch.Tensor | None = None


class _CaptureGrad(torch.autograd.Function):
    """Identity whose backward remembers the gradient of an op's output."""

    @staticmethod
    def forward(ctx, t, slot):
        ctx.slot = slot
        return t.clone()  # not a view: callers may modify the result in place (masked_fill_)

    @staticmethod
    def backward(ctx, g):
        ctx.slot.g = g
        return g, None


class _PerturbGrad(torch.autograd.Function):
    """Identity whose backward adds ``noise_fn(grad)`` to the gradient of an op's input."""

    @staticmethod
    def forward(ctx, t, noise_fn):
        ctx.noise_fn = noise_fn
        return t.clone()  # not a view: callers may modify the result in place (masked_fill_)

    @staticmethod
    def backward(ctx, g):
        return (g.to(_work_dtype(g.dtype)) + ctx.noise_fn(g)).to(g.dtype), None


class NoiseInjector(TorchFunctionMode):
    """Perturb every modelled op by a random error within its local bound (see module doc).

    Args:
        generator: source of the noise (reproducibility).
        mode, failure_probability, policy, against_exact: as for the analytic shadow; they
            select the local bound of each op. With ``against_exact`` an elementwise
            rounding's noise is half an ulp, and the result plus it, stored in the result's
            format, rounds back to the result: those ops add no spread in this mode (two runs'
            noise, an ulp, moves about half of the elements by one ulp;
            ``tests/test_local_rounding.py``).
        backward: also perturb gradients.
        grad_summation: the summation model of the *other* run for the sums over tokens that
            make parameter-like gradients (norm weight/bias, broadcast biases), e.g.
            ``Summation(split=tp, reduce_fmt="bf16")`` for a run whose sequence is split over
            ``tp`` ranks; None: the default model.
        calibration: a calibration (or its file) for the bounds of the ops it calibrates
            (:class:`~.local.LocalBounds`), the GEMMs of the backward included; the other
            gradient bounds stay analytic.
        variance_model: variance-matched noise for GEMMs in forward and backward whose
            operands and result share one dtype (fp32, bf16 or fp16; a narrow result adds its
            rounding's variance) and for fp32 parameter-gradient sums over tokens: instead of
            ``U * b`` from a bound, noise with the *variance* of the difference between an
            unsplit random-order fp32 run and a run of this model (e.g.
            ``Summation(split=tp, reduce_fmt="bf16")``),
            :mod:`ttrace_num.bounds.summation_variance`. ``None``: bounds everywhere.
        reference_model: the computation model of the run the injector perturbs, for that
            variance (the first of the two runs): ``None`` an unsplit run (a single-device
            reference); a *distributed* reference that itself splits its GEMMs over ``k`` TP
            ranks passes ``Summation(split=k, reduce_fmt=...)``, so that the noise has the
            variance of its own split plus the candidate's (``variance_model``). Applied
            wherever the variance model is (the fp32 parameter-gradient sums over tokens too,
            which a reference without sequence parallelism does not split: conservative there).
        memo: amplitudes shared by the samples of one step (:mod:`.memo`): the first
            sample's injector computes and stores them, the next ones reuse those of matching
            calls. ``None``: every amplitude is computed.
        accepted: ``{torch name: reason}`` of ops without a model that the caller accepts
            unperturbed (counted ``accepted`` in :meth:`census`, not ``unmodelled``).
        layout: what the candidate's layout changes, per module (``module_of``) and kind of
            computation (:mod:`.layout`): an op the candidate computes identically gets no noise
            (counted ``identical``), a reduction it splits gets the difference of the two runs'
            summation models, and the rule's ``None`` leaves the op to the models above.

    :meth:`census` counts every call the mode saw (:mod:`.census`): ``perturbed``, ``exact``,
    ``unmodelled`` (rounding arithmetic without a model: not perturbed, and reported),
    ``optimizer`` (such ops inside :meth:`optimizer_step`) and ``accepted``.
    """

    def __init__(self, generator: torch.Generator, mode: str = "deterministic",
                 failure_probability: float | None = None, policy: ModelPolicy | None = None,
                 against_exact: bool = False, backward: bool = True, module_of: Callable[[], str] | None = None,
                 calibration: "Calibration | str | None" = None, grad_summation: "Summation | None" = None,
                 variance_model: "Summation | None" = None, memo: AmplitudeMemo | None = None,
                 accepted: "dict[str, str] | None" = None, reference_model: "Summation | None" = None,
                 layout: "LayoutRule | None" = None):
        super().__init__()
        self.layout = layout
        #: the module whose custom autograd backward is running (:func:`perturb_custom_backward`)
        self.backward_module: str | None = None
        self.reference_model = reference_model
        self.memo = memo
        self.gen = generator
        self.grad_summation = grad_summation
        self.variance_model = variance_model
        self.local = LocalBounds(mode, failure_probability, policy, against_exact, calibration)
        self.backward = backward
        self.module_of = module_of or (lambda: "")
        self.perturbed = 0
        self._census = Census()
        self._in_optimizer = False
        self.accepted = dict(accepted or {})

    def census(self) -> dict[str, dict[str, int]]:
        """What this injector saw, per torch function and category (:mod:`.census`):
        ``{"perturbed": {name: calls}, "exact": {...}, "unmodelled": {...}}``."""
        return self._census.as_dict()

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Mark the optimizer's ``step()``: inside, an op without a model is counted as
        ``optimizer``, not ``unmodelled`` (:mod:`.census`: the update is elementwise and the
        candidate is assumed to run the same optimizer); modelled ops are perturbed as anywhere."""
        before, self._in_optimizer = self._in_optimizer, True
        try:
            yield
        finally:
            self._in_optimizer = before

    @property
    def unmodelled_calls(self) -> int:
        """Calls so far of ops that can round and have no error model (:mod:`.census`)."""
        return self._census.unmodelled_calls

    def _noise(self, b: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
               work: torch.dtype | None = None) -> torch.Tensor:
        """``U * b``, ``U ~ Uniform[-1, 1]`` elementwise (drawn in float32, ~0.65x the cost of
        float64 draws on this CPU: ``U`` needs no more than 24 random bits), in ``work``,
        by default the working dtype of a result of ``dtype`` (:func:`_work_dtype`). The caller
        passes float32 for a float32 result only where ``U b`` is exact there: ``U`` is a
        multiple of 2^-23, so ``b`` must be 0, inf, NaN or a power of two no smaller than 2^-126
        (the rounding amplitudes of ``LocalBounds.rounding(fp32=True)``, doubled or not); then
        the noise, and the result plus it rounded once, are those of the float64 arithmetic."""
        u = torch.rand(shape, generator=self.gen, dtype=torch.float32).mul_(2).sub_(1)
        work = work or _work_dtype(dtype)
        return (u if work == torch.float32 else u.to(work)).mul_(b.to(work) if isinstance(b, torch.Tensor) else b)

    def _amplitude(self, what: str, operands: tuple, compute: Callable[[], torch.Tensor],
                   output: torch.Tensor | None = None,
                   rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``compute()``, or the amplitude :attr:`memo` holds for this call (``operands`` and a
        forward call's ``output``: what it depends on; ``rows``: the amplitude of some rows of
        the result, for a GEMM with a 2-D right operand, see :meth:`.memo.AmplitudeMemo.get`)."""
        if self.memo is None:
            return compute()
        return self.memo.get(f"{what}@{self._module()}", operands, compute, output, rows)

    def _module(self) -> str:
        """The module of the op running: the one whose custom backward runs
        (:attr:`backward_module`), else ``module_of()``."""
        return self.backward_module if self.backward_module is not None else self.module_of()

    def _rule(self, computation: str, module: str) -> "str | Summation | None":
        """The layout's model of ``computation`` in ``module`` (:mod:`.layout`); None without one."""
        return None if self.layout is None else self.layout(module, computation)

    def _variance_amplitude(self, q: torch.Tensor, c: torch.Tensor, n: int, shape: torch.Size,
                            exact_products: bool = True, models: "tuple[Summation | None, ...] | None" = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Amplitude of uniform noise with the variance of the difference of two runs (``models``;
        default a run of :attr:`reference_model`, unsplit when None, and one of :attr:`variance_model`) of sums with statistics
        ``Q``, ``C`` over ``n`` terms, results stored in ``out_dtype``
        (:func:`~ttrace_num.bounds.summation_variance.gemm_difference_variance`):
        ``sqrt(3 (V_a + V_b))``, as ``Var(U) = 1/3``."""
        models = models or (self.reference_model, self.variance_model)
        out_fmt = get_format(out_dtype) if out_dtype in NARROW_DTYPES else None
        var = gemm_difference_variance(q, c, n, exact_products, models, out_fmt)
        return torch.sqrt(3.0 * torch.broadcast_to(var, shape)).reshape(shape)

    def _variance_applies(self, *tensors: torch.Tensor) -> bool:
        """Variance-matched noise for a sum of fp32 terms into an fp32 result."""
        return self.variance_model is not None and all(t.dtype == torch.float32 for t in tensors)

    def _gemm_variance_applies(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                               split: "Summation | None" = None) -> bool:
        """Variance-matched noise for a GEMM whose operands and result share a dtype: fp32, or
        bf16/fp16 (accumulated in fp32, the result rounded; ``summation_variance`` module doc).
        Mixed operands (an FP8 GEMM's scaled inputs, a bf16 x fp32 product) keep their bounds.
        ``split``: the layout's model of this GEMM (:mod:`.layout`), which applies it whatever
        :attr:`variance_model` is."""
        return ((self.variance_model is not None or split is not None) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype == out_dtype and out_dtype in (torch.float32,) + NARROW_DTYPES)

    def _gemm_bound(self, a: torch.Tensor, b: torch.Tensor, split: "Summation | None" = None) -> torch.Tensor:
        """Local bound of a GEMM ``a @ b`` computed in backward, the same model as a forward GEMM
        (:meth:`~.local.LocalBounds.of`): the policy's difference of the two runs' models when
        it has one (a TP candidate splits the input-gradient GEMMs of its column-parallel
        layers and sums the partials in the activation dtype, as the forward of its row-parallel
        ones), else two independent runs' bounds. ``split``: the layout's model of the
        candidate's GEMM (:mod:`.layout`): the difference bound of the reference's model
        (:attr:`reference_model`, unsplit when None) and that one."""
        if split is not None:
            return tn.difference("matmul", a, b, model_a={"summation": self.reference_model or Summation()},
                                 model_b={"summation": split}, **self.local.common_kwargs()).abs
        return self.local.of(OpCall("op", "matmul", (a, b)), None, self._module())

    def _gemm_noise(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, shape: torch.Size,
                    dtype: torch.dtype, output: torch.Tensor | None = None, split: "Summation | None" = None
                    ) -> torch.Tensor:
        """Noise of a GEMM result ``a @ b (+ bias)`` of ``dtype``: of :meth:`_variance_amplitude`
        where :meth:`_gemm_variance_applies` (forward and backward); else, in backward, ``U``
        times :meth:`_gemm_bound`. ``split``: the layout's model of the candidate's GEMM
        (:mod:`.layout`), in place of :attr:`variance_model` and the policy."""
        def amplitude(a: torch.Tensor, shape: torch.Size) -> torch.Tensor:
            if self._gemm_variance_applies(a, b, dtype, split):
                q, c, n, exact = matmul_sum_statistics(a, b, bias)
                models = (self.reference_model, split) if split is not None else None
                return self._variance_amplitude(q.reshape(shape), c.reshape(shape), n, shape, exact,
                                                models=models, out_dtype=dtype)
            return self._gemm_bound(a, b, split).reshape(shape)

        def rows(index: torch.Tensor) -> torch.Tensor:
            return amplitude(_rows_of(a, index), torch.Size((index.numel(), shape[-1])))
        by_rows = rows if _row_separable(a, b, shape) else None
        return self._noise(self._amplitude("gemm", (a, b, bias), lambda: amplitude(a, shape), output, by_rows),
                           shape, dtype)

    def _grad_rounding(self, g: torch.Tensor) -> torch.Tensor:
        b = half_ulp(g.detach(), get_format(g.dtype), _work_dtype(g.dtype))
        return self._noise(b if self.local.against_exact else 2 * b, g.shape, g.dtype)

    def _grad_noise_fns(self, call: OpCall, slot: _Slot, module: str
                        ) -> list[Callable[[torch.Tensor], torch.Tensor] | None]:
        """One noise function per tensor input of ``call`` (None: no backward rounding), in
        ``module``: where the layout (:mod:`.layout`) says the candidate computes a gradient
        identically, none; where it splits a GEMM or a sum over tokens, that model's."""
        token_sum = self._rule("token_sum", module)
        if call.op in ("linear", "matmul"):
            return self._gemm_grad_fns(call, slot, self._rule("dgrad", module), self._rule("wgrad", module),
                                       token_sum)
        if call.op == "add":  # a broadcast input's gradient is a sum over the broadcast dims
            return [self._broadcast_sum_noise(t, slot, token_sum) if isinstance(t, torch.Tensor) else None
                    for t in call.inputs]
        if call.kind == "index":
            return [None if token_sum == IDENTICAL else self._embedding_grad_fn(call, slot, token_sum)]
        if self._rule("op", module) == IDENTICAL:
            return [None] * (3 if call.op == "attention" else len(call.inputs))
        if call.op == "attention":
            return self._attention_grad_fns(call, slot)
        if call.op == "cross_entropy":
            return [self._cross_entropy_grad_fn(call, slot), None]
        if call.op == "mse_loss":
            fn = self._mse_grad_fn(call, slot)
            return [fn, fn]
        if call.op == "add_scalar" or (call.kind == "rounding" and call.exact):
            return [None] * len(call.inputs)  # gradient passes through exactly
        return [self._grad_rounding] * len(call.inputs)

    def _gemm_grad_fns(self, call: OpCall, slot: _Slot, dgrad: "str | Summation | None",
                       wgrad: "str | Summation | None", token_sum: "str | Summation | None") -> list:
        """Gradient noise of a ``linear``/``matmul``'s input, weight (and bias): GEMMs (and a sum
        over tokens) of the models the layout gives them (:mod:`.layout`; None: the defaults)."""
        x, w = call.inputs[0], call.inputs[1]
        wt = w if call.op == "linear" else w.transpose(-1, -2)  # grad_x = g @ wt

        def gx(g):
            return self._gemm_noise(slot.g, wt, None, g.shape, g.dtype, split=_split(dgrad))

        def gw(g):
            go = slot.g.reshape(-1, slot.g.shape[-1])
            xi = x.reshape(-1, x.shape[-1]).detach()
            if call.op == "linear":  # grad_W = g^T x, shape (out, in)
                return self._gemm_noise(go.transpose(0, 1), xi, None, g.shape, g.dtype, split=_split(wgrad))
            xt = x.detach().transpose(-1, -2)  # grad_B = A^T g, summed over batch dims
            return self._noise(self._amplitude("batched-weight-grad", (xt, slot.g),
                                               lambda: self._batched_weight_grad_amplitude(xt, slot.g, g.shape)),
                               g.shape, g.dtype)

        fns: list = [None if dgrad == IDENTICAL else gx, None if wgrad == IDENTICAL else gw]
        if len(call.inputs) > 2:  # bias: sum of the output gradient over the tokens
            fns.append(None if token_sum == IDENTICAL else
                       self._sum_noise(lambda: slot.g, call.inputs[2].shape, call.inputs[2].dtype,
                                       split=_split(token_sum)))
        return fns

    def _attention_grad_fns(self, call: OpCall, slot: _Slot) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Gradient noise of ``F.scaled_dot_product_attention``'s ``q``, ``k``, ``v``: ``U`` times the
        bounds on the computed ``dQ``, ``dK``, ``dV`` of
        :func:`ttrace_num.bounds.attention.attention_backward` for the kernel torch runs on CPU
        (:func:`~ttrace_num.bounds.attention.torch_cpu_sdpa_model` with ``backward=True``: ``P``
        recomputed from the stored log-sum-exp, ``D = rowsum(dO * O)``, ``dS`` and the gradients'
        block accumulation in the input dtype), given the output gradient ``dO``; twice the
        bound for two runs (as every op's local bound), once against exact. The three bounds
        are computed together, once per call (or reused from :attr:`memo`)."""
        from ..bounds.attention import attention_backward, torch_cpu_sdpa_model
        q, k, v = (t.detach() for t in call.inputs)
        kw = {n: call.kwargs[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa")}
        kw.update(torch_cpu_sdpa_model(q, backward=True))
        scale = 1.0 if self.local.against_exact else 2.0
        cache: dict[str, object] = {}

        def bounds():
            if "b" not in cache:
                cache["b"] = attention_backward(q, k, v, slot.g.detach(), **kw, **self.local.common_kwargs())
            return cache["b"]

        def fn(i: int, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
            def noise(g: torch.Tensor) -> torch.Tensor:
                amp = self._amplitude(f"attention_{name}", (q, k, v, slot.g), lambda: scale * bounds()[i].abs)
                return self._noise(amp.reshape(g.shape), g.shape, g.dtype)
            return noise
        return [fn(0, "dq"), fn(1, "dk"), fn(2, "dv")]

    def _cross_entropy_grad_fn(self, call: OpCall, slot: _Slot) -> Callable[[torch.Tensor], torch.Tensor]:
        """Gradient noise of ``F.cross_entropy``'s logits: ``U`` times the bound of
        :func:`ttrace_num.bounds.grads.cross_entropy_backward` (torch's CPU computation of
        ``d loss / d logits``, the upstream gradient ``grad_output`` the scalar that reaches the
        loss, e.g. ``1/n`` of a ``loss / n``), twice for two runs; for ``reduction="none"`` (no
        scalar upstream gradient) one rounding of the gradient, as for the other non-GEMM ops
        (module doc)."""
        x, t = call.inputs[0].detach(), call.inputs[1]
        kw = {n: call.kwargs[n] for n in ("reduction", "label_smoothing", "ignore_index")}
        scale = 1.0 if self.local.against_exact else 2.0

        def noise(g: torch.Tensor) -> torch.Tensor:
            go = slot.g
            if go is None or go.numel() != 1 or kw["reduction"] == "none":
                return self._grad_rounding(g)
            amp = self._amplitude("cross_entropy_backward", (x, t, go), lambda: scale * tn.tolerance(
                "cross_entropy_backward", x, t, grad_output=float(go), **kw, **self.local.common_kwargs()).abs)
            return self._noise(amp.reshape(g.shape), g.shape, g.dtype)
        return noise

    def _mse_grad_fn(self, call: OpCall, slot: _Slot) -> Callable[[torch.Tensor], torch.Tensor]:
        """Gradient noise of ``F.mse_loss``'s input (and target): ``U`` times the bound of
        :func:`ttrace_num.bounds.losses.mse_loss_backward` (up to four roundings of torch's CPU
        kernel ``norm * (x - y) * grad``, given the upstream gradient), twice for two runs."""
        x, y = (t.detach() for t in call.inputs)
        scale = 1.0 if self.local.against_exact else 2.0

        def noise(g: torch.Tensor) -> torch.Tensor:
            if slot.g is None:
                return self._grad_rounding(g)
            amp = self._amplitude("mse_loss_backward", (x, y, slot.g), lambda: scale * tn.tolerance(
                "mse_loss_backward", x, y, slot.g.detach(), reduction=call.kwargs["reduction"],
                **self.local.common_kwargs()).abs)
            return self._noise(torch.broadcast_to(amp, g.shape), g.shape, g.dtype)
        return noise

    def _embedding_grad_fn(self, call: OpCall, slot: _Slot, split: "Summation | None" = None
                           ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Gradient noise of ``F.embedding``'s weight. Its forward is exact (a gather of rows);
        its weight gradient is, per vocabulary row ``r``, the sum of the output gradients of the
        tokens with index ``r``. torch's CPU kernel (``embedding_dense_backward_cpu``) adds them
        one by one, in token order, into the row of a gradient of the weight's dtype: each
        addition computed in fp32 and rounded to that dtype. For bf16/fp16 that is recursive
        summation correctly rounded in the weight's format (the fp32 sum of two of its values
        is exact unless their exponents differ by more than the fp32-minus-format precision,
        and then the smaller is below half an ulp of the larger and both roundings return the
        larger), so the bound is :func:`ttrace_num.bounds.reduction.sum_` of each row's terms
        with ``Summation(accum=<weight dtype>)`` (under ``grad_summation``'s split and reduction
        format, as the token sums of the norm weights), twice for two runs. ``recursive``
        bounds every order, so a kernel that sorts the indices is covered too. Rows are
        grouped by their number of occurrences (one ``(count, rows, D)`` tensor per distinct
        count: the terms take the memory of the gradient once); rows no token uses have an
        exactly zero gradient (amplitude 0). ``split``: the layout's model of the candidate's
        token sums (:mod:`.layout`), in place of ``grad_summation``."""
        w = call.inputs[0]
        idx, pad = call.kwargs["indices"], call.kwargs["padding_idx"]
        scale = 1.0 if self.local.against_exact else 2.0
        gs = _split(split) or self.grad_summation
        model = Summation(accum=get_format(w.dtype), split=gs.split if gs else 1,
                          reduce_fmt=gs.reduce_fmt if gs else None)

        def amplitude(shape: torch.Size) -> torch.Tensor:
            rows_n, d = w.shape[0], w.shape[-1]
            go = slot.g.detach().reshape(-1, d)
            flat = idx.reshape(-1).to(torch.int64)
            if pad is not None:
                keep = flat != (pad % rows_n)
                go, flat = go[keep], flat[keep]
            amp = torch.zeros((rows_n, d), dtype=torch.float64)
            counts = torch.bincount(flat, minlength=rows_n)
            order = torch.argsort(flat, stable=True)
            starts = torch.cumsum(counts, 0) - counts
            for c in (int(n) for n in torch.unique(counts) if int(n) > 1):  # one term: exact
                rows = torch.nonzero(counts == c).flatten()
                pos = starts[rows][None, :] + torch.arange(c)[:, None]  # (c, rows): the k-th occurrence
                terms = go[order[pos]]  # (c, rows, d), in token order
                amp[rows] = scale * tn.tolerance("sum", terms, dim=0, summation=model,
                                                 **self.local.common_kwargs()).abs
            return amp.reshape(shape)

        def noise(g: torch.Tensor) -> torch.Tensor:
            if slot.g is None:
                return torch.zeros(g.shape, dtype=_work_dtype(g.dtype))
            amp = self._amplitude("embedding_backward", (idx, slot.g), lambda: amplitude(g.shape))
            return self._noise(amp, g.shape, g.dtype)
        return noise

    def _batched_weight_grad_amplitude(self, xt: torch.Tensor, g_out: torch.Tensor, shape: torch.Size
                                       ) -> torch.Tensor:
        """Amplitude for the gradient of a batched matmul's weight ``B`` (``grad_B = A^T g``
        summed over the batch dims, result ``shape``): of one sum over batch x K terms."""
        if self._variance_applies(xt, g_out):
            q, c, k, exact = matmul_sum_statistics(xt, g_out)
            n = k * (q.numel() // max(shape.numel(), 1))  # one sum over batch x K terms
            while q.dim() > len(shape):
                q, c = q.sum(0), c.sum(0)
            return self._variance_amplitude(q, c, n, shape, exact)
        b = self._gemm_bound(xt, g_out)
        while b.dim() > len(shape):
            b = b.sum(0)
        b = torch.broadcast_to(b, shape) if b.shape != shape else b
        return b.reshape(shape)

    def _sum_noise(self, terms: Callable[[], torch.Tensor], shape: torch.Size, dtype: torch.dtype,
                   chain_in_dtype: bool = False, operands: Callable[[], tuple] | None = None,
                   split: "Summation | None" = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """Noise for a parameter-like gradient ``sum_k terms()[k]`` (shape ``(K, *shape)``): the
        sum bound under ``grad_summation`` (e.g. split over TP ranks under sequence
        parallelism), twice for two runs.

        ``chain_in_dtype``: the kernel adds the terms into a running sum stored in ``dtype``
        (torch's CPU layer-norm backward accumulates ``dgamma``/``dbeta`` of a bf16/fp16 norm
        row by row in a buffer of the input's dtype, then sums the threads' buffers in float:
        measured 22-88 half-ulps of the result, rms). The noise then has the variance of that
        chain in the reference (all ``K`` terms) and in a candidate that splits the terms like
        ``grad_summation`` and reduces the parts in fp32
        (:mod:`~ttrace_num.bounds.summation_variance`): a bound of a bf16 chain over ``K``
        terms would be ~``lambda sqrt(K) 2^-8`` of the sum of magnitudes, 10-25x the spread.
        Its absorption of small addends is one-sided: the difference between the chain over all
        terms and over the ``grad_summation`` split, emulated on the terms
        (:func:`~ttrace_num.bounds.summation_variance.chain_split_difference`), is added in
        square to the variance. Where such a chain can absorb whole addends (long, of one sign:
        ``may_stagnate``), those elements take the deterministic difference bound.

        ``operands``: what the terms are computed from, for :attr:`memo` (default the terms).
        ``split``: the layout's model of the candidate's sum (:mod:`.layout`), in place of
        ``grad_summation`` and ``variance_model``."""
        scale = 1.0 if self.local.against_exact else 2.0
        summation = split or self.grad_summation
        kw = {**self.local.common_kwargs(), **({"summation": summation} if summation else {})}

        def amplitude(g: torch.Tensor) -> torch.Tensor:
            exact_terms = terms().detach().reshape(-1, *shape)  # computed once (x_hat is a pass of its own)
            t = exact_terms.to(dtype)
            parts = summation.split if summation else 1
            if chain_in_dtype:
                models = (Summation(accum=dtype), Summation(accum=dtype, split=parts, reduce_fmt="fp32"))
            elif split is not None and t.dtype == torch.float32:
                models = (self.reference_model, split)
            elif self._variance_applies(t):
                models = None  # a run of reference_model (unsplit fp32) vs one of variance_model
            else:
                return scale * tn.tolerance("sum", t, dim=0, **kw).abs.reshape(g.shape)
            t64 = t.double()
            q, c = (t64 * t64).sum(0).reshape(g.shape), t64.sum(0).reshape(g.shape)
            # the terms may be rounded products (g * x_hat)
            amp = self._variance_amplitude(q, c, t.shape[0], g.shape, exact_products=False, models=models)
            if chain_in_dtype:  # the chain's one-sided part, then where it can absorb whole addends
                systematic = chain_split_difference(exact_terms, dtype, parts)
                amp = torch.sqrt(amp * amp + 3.0 * systematic.reshape(g.shape) ** 2)
                stuck = may_stagnate(t64, get_format(dtype)).reshape(g.shape)
                if bool(stuck.any()):
                    worst = tn.difference("sum", t, dim=0, model_a={"summation": models[0]},
                                          model_b={"summation": models[1]}, mode="deterministic")
                    amp = torch.where(stuck, worst.abs.reshape(g.shape), amp)
            return amp

        def fn(g: torch.Tensor) -> torch.Tensor:
            deps = operands() if operands is not None else (terms(),)
            return self._noise(self._amplitude("sum", deps, lambda: amplitude(g)), g.shape, g.dtype)
        return fn

    def _broadcast_sum_noise(self, t: torch.Tensor, slot: _Slot, token_sum: "str | Summation | None" = None):
        """Gradient noise of an ``add`` input broadcast along leading dims (a bias): None when
        ``t`` is not broadcast (its gradient passes through exactly), or when the layout's
        ``token_sum`` model is :data:`~.layout.IDENTICAL`."""
        def terms():
            return slot.g
        if not t.requires_grad or t.dim() == 0 or token_sum == IDENTICAL:
            return None
        return lambda g: (self._sum_noise(terms, t.shape, g.dtype, split=_split(token_sum))(g) if slot.g is not None
                          and slot.g.numel() > t.numel() and tuple(slot.g.shape[-t.dim():]) == tuple(t.shape)
                          else torch.zeros(g.shape, dtype=torch.float64))

    def _norm_param_noise(self, call: OpCall, slot: _Slot, token_sum: "str | Summation | None" = None
                          ) -> dict[int, Callable]:
        """Gradient noise of a norm's weight and bias: sums over the tokens of
        ``g * x_hat`` and ``g`` (see :meth:`_sum_noise`), under the layout's ``token_sum`` model
        (none where it is :data:`~.layout.IDENTICAL`). Keys: argument positions 2, 3."""
        if token_sum == IDENTICAL:
            return {}
        x_in = call.inputs[0].detach()
        shape, eps = tuple(call.kwargs["normalized_shape"]), call.kwargs["eps"]
        dims = tuple(range(-len(shape), 0))

        def xhat() -> torch.Tensor:  # in backward, only when an amplitude is computed
            x = x_in.double()
            if call.op == "layer_norm":
                x = x - x.mean(dims, keepdim=True)
            return x / torch.sqrt((x * x).mean(dims, keepdim=True) + eps)
        out = {}
        w, b = call.kwargs.get("weight"), call.kwargs.get("bias")
        # torch's CPU layer-norm backward chains dgamma/dbeta in the input's dtype (see _sum_noise)
        chain = call.op == "layer_norm" and x_in.device.type == "cpu" and x_in.dtype in (torch.bfloat16, torch.float16)
        if isinstance(w, torch.Tensor) and w.requires_grad:
            out[2] = self._sum_noise(lambda: slot.g.double() * xhat(), w.shape, w.dtype, chain,
                                     operands=lambda: (slot.g, x_in), split=_split(token_sum))
        if isinstance(b, torch.Tensor) and b.requires_grad:
            out[3] = self._sum_noise(lambda: slot.g, b.shape, b.dtype, chain, split=_split(token_sum))
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = classify(func, args, kwargs)
        if call is not None and (call.kind in ("structural", "masked_fill") or not any(
                isinstance(t, torch.Tensor) and t.is_floating_point() for t in call.inputs)):
            self._census.add("exact", op_name(func))
            return func(*args, **kwargs)
        distributed = _distributed_tensor_call(args, kwargs)
        if call is None or distributed:
            out = func(*args, **kwargs)
            name = op_name(func)
            if call is not None:  # a DTensor's op: exact (a gather, power-of-two scaling, widening cast), or
                category = "unmodelled" if _rounds(call, out) else "exact"  # rounding on each rank's shard
            else:
                category = unclassified_category(func, args, kwargs, out)
            if distributed and category == "unmodelled":
                name = f"DTensor {name}"
            if category == "unmodelled":
                category = "optimizer" if self._in_optimizer else ("accepted" if name in self.accepted else category)
            self._census.add(category, name)
            return out
        slot = _Slot()
        module = self._module()
        if self.backward and torch.is_grad_enabled():
            fns = self._grad_noise_fns(call, slot, module)
            if call.op == "attention":  # by position: q, k, v may be one tensor
                args, kwargs = _wrap_at(args, kwargs, ("query", "key", "value"), fns)
            elif call.kind == "index":
                args, kwargs = _wrap_at(args, kwargs, ("input", "weight"), [None] + fns)
            else:
                args = tuple(_wrap(a, call.inputs, fns) for a in args)
            if call.op in ("layer_norm", "rms_norm"):
                args, kwargs = _wrap_norm_params(args, kwargs,
                                                 self._norm_param_noise(call, slot, self._rule("token_sum", module)))
            call = classify(func, args, kwargs)  # inputs are now the wrapped tensors
        out = func(*args, **kwargs)
        if not _rounds(call, out):  # an exact gather, power-of-two scaling or widening cast
            self._census.add("exact", op_name(func))
            if call.kind == "index":
                return _CaptureGrad.apply(out, slot) if self.backward and out.requires_grad else out
            if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
                return out  # a cast to an integer type: nothing to perturb
        rule = None
        if _rounds(call, out):
            gemm = call.op in ("linear", "matmul")
            rule = self._rule(gemm_computation(call.inputs, self.backward_module is not None) if gemm else "op", module)
            self._census.add("identical" if rule == IDENTICAL else "perturbed", op_name(func))
        with torch._C.DisableTorchFunction():  # the injector's own arithmetic: no other mode sees it
            return self._perturbed(call, out, slot, module, rule)

    def _perturbed(self, call: OpCall, out: torch.Tensor, slot: _Slot, module: str,
                   rule: "str | Summation | None" = None) -> torch.Tensor:
        """``out`` plus the noise of ``call`` (module doc), differentiable when ``out`` is;
        ``rule``: the layout's model of the call (:mod:`.layout`): :data:`~.layout.IDENTICAL`
        adds no noise, a ``Summation`` is the candidate's model of a GEMM."""
        gemm = call.op in ("linear", "matmul")
        if rule == IDENTICAL:
            noise = None
        elif gemm and (rule is not None or self._gemm_variance_applies(call.inputs[0], call.inputs[1], out.dtype)):
            a, w = call.inputs[0], call.inputs[1]
            bias = call.inputs[2] if len(call.inputs) > 2 else None
            noise = self._gemm_noise(a, w.transpose(-1, -2) if call.op == "linear" else w, bias, out.shape,
                                     out.dtype, out, split=_split(rule))
        elif call.kind == "op":  # a model's bound: worth reusing (a rounding's costs less than a lookup)
            kwargs_in = tuple(v for _, v in sorted(call.kwargs.items()))
            noise = self._noise(self._amplitude(call.op, call.inputs + kwargs_in,
                                                lambda: self.local.of(call, out, module), out,
                                                _gemm_rows(call, out, lambda c: self.local.of(c, None, module))),
                                out.shape, out.dtype)
        else:  # one rounding: a float32 result's exactly in float32 where its amplitudes are float32
            b = self.local.of(call, out, module, fp32=True)
            noise = self._noise(b, out.shape, out.dtype, b.dtype if b.dtype == out.dtype == torch.float32 else None)
        if noise is None:
            return _CaptureGrad.apply(out, slot) if self.backward and out.requires_grad else out
        noisy = (out.detach().to(noise.dtype) + noise).to(out.dtype)
        self.perturbed += 1
        if out.requires_grad:
            # infinite entries (a -inf attention mask through a cast) stay as they are: inf - inf is NaN
            delta = torch.where(torch.isfinite(out), noisy.detach() - out.detach(), 0.0).to(out.dtype)
            out = out + delta
            if self.backward:
                out = _CaptureGrad.apply(out, slot)
            return out
        return noisy


def _split(rule: "str | Summation | None") -> "Summation | None":
    """The ``Summation`` of a layout rule's answer (:mod:`.layout`); None for the others."""
    return rule if isinstance(rule, Summation) else None


def _distributed_tensor_call(args: tuple, kwargs: dict) -> bool:
    """A call on a distributed tensor (``DTensor``: FSDP2's gradients in a ``clip_grad_norm_``, an
    optimizer over sharded parameters), directly or in a list argument. It is not perturbed: its
    bound would have to be taken on each rank's local shard and combined over the mesh, which
    this injector does not model. The census counts it under its name prefixed ``DTensor ``
    (unmodelled unless accepted, like any op without a model)."""
    def dist(a) -> bool:
        return any(c.__name__ == "DTensor" for c in type(a).__mro__) if isinstance(a, torch.Tensor) else False
    return any(dist(a) or (isinstance(a, (list, tuple)) and any(dist(x) for x in a))
               for a in (*args, *kwargs.values()))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the noise of a result of ``dtype`` is drawn and added before the result is rounded
    back: float32 for bf16/fp16 results (which it holds exactly; the sum then rounds twice, which
    differs from one rounding only at the ties of a double rounding, immaterial for random
    noise, and costs a third of float64 arithmetic on 2M-element results), float64 otherwise
    (an fp32 result's noise is a fraction of its own ulp)."""
    return torch.float32 if dtype in NARROW_DTYPES else torch.float64


def _gemm_rows(call: OpCall, out: torch.Tensor, bound: Callable[[OpCall], torch.Tensor]
               ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a ``linear``/``matmul`` call with a 2-D right operand: the function giving the
    local bound of the result's rows ``index`` (flat over the leading dimensions) from those
    rows of the left operand (see :meth:`.memo.AmplitudeMemo.get`); None for other calls."""
    if call.op not in ("linear", "matmul") or len(call.inputs) < 2:
        return None
    a, b = call.inputs[0], call.inputs[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _row_separable(a, b, out.shape)):
        return None

    def rows(index: torch.Tensor) -> torch.Tensor:
        sub = replace(call, inputs=(_rows_of(a, index),) + tuple(call.inputs[1:]))
        return bound(sub).reshape(index.numel(), out.shape[-1])
    return rows


def _row_separable(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> bool:
    """The bound of ``a @ b`` (result ``shape``) is computed row by row from the rows of ``a``
    and the whole of ``b``: ``b`` is 2-D and the result's rows are ``a``'s."""
    return b.dim() == 2 and a.dim() >= 2 and tuple(a.shape[:-1]) == tuple(shape[:-1])


def _rows_of(a: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``a``, flat over its leading dimensions."""
    return a.reshape(-1, a.shape[-1])[index]


def _rounds(call: OpCall, out) -> bool:
    """Can ``call`` (result ``out``) round? Not a gather (``index``), an exact scaling, or a cast
    to the same format, a wider one or an integer type; every ``op`` rounds."""
    if call.kind == "index":
        return False
    if call.kind != "rounding":
        return True
    if call.exact or not (isinstance(out, torch.Tensor) and out.is_floating_point()):
        return False
    if call.op == "cast":
        src = call.inputs[0].dtype
        if out.dtype == src:
            return False
        try:
            from ..bounds.summation import conversion_exact
            return not conversion_exact(get_format(src), get_format(out.dtype))
        except (KeyError, ValueError, TypeError):
            return True
    return True


def _wrap_at(args: tuple, kwargs: dict, names: tuple[str, ...], fns: list) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the tensor at position ``i`` (or keyword ``names[i]``) wrapped to
    get ``fns[i]``'s gradient noise, when it requires grad; by position, so that one tensor
    passed twice (self-attention's ``q = k = v``) gets each position's noise."""
    args, kwargs = list(args), dict(kwargs)
    for i, (name, fn) in enumerate(zip(names, fns)):
        if fn is None:
            continue
        if len(args) > i:
            if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
                args[i] = _PerturbGrad.apply(args[i], fn)
        elif isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].requires_grad:
            kwargs[name] = _PerturbGrad.apply(kwargs[name], fn)
    return tuple(args), kwargs


def _wrap(a, inputs: tuple, fns: list):
    """``a`` wrapped so its gradient gets noise, if it is a differentiable op input."""
    if not (isinstance(a, torch.Tensor) and a.requires_grad):
        return a
    for x, fn in zip(inputs, fns):
        if x is a and fn is not None:
            return _PerturbGrad.apply(a, fn)
    return a


@contextlib.contextmanager
def perturb_custom_backward(injector: TorchFunctionMode, *functions: type) -> Iterator[None]:
    """Run the backward of the given ``torch.autograd.Function`` classes under ``injector``.

    Autograd calls a custom Function's ``backward`` without the torch-function modes that
    were active around ``loss.backward()`` (measured, torch 2.13), so the GEMMs inside, e.g.
    megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` (input and weight
    gradients of every tensor-parallel linear), would escape the injector. Inside the patched
    backward they are ordinary (no-grad) op calls, perturbed by their local bound. The patched
    forward notes the module it runs in (the injector's ``module_of``), and the backward runs with
    it as the injector's :attr:`~NoiseInjector.backward_module`, for the layout's rules
    (:mod:`.layout`: a GEMM there is a ``dgrad`` or a ``wgrad``); another ``TorchFunctionMode``
    as ``injector`` just runs the backward under it.
    """
    saved = {f: (f.__dict__["forward"], f.__dict__["backward"]) for f in functions}

    tracks_modules = isinstance(injector, NoiseInjector)  # any other mode just runs the backward

    def patched_forward(orig):
        def forward(ctx, *args, **kwargs):
            if tracks_modules:
                ctx.ttrace_module = injector.module_of()
            return orig.__func__(*((ctx,) + args), **kwargs)
        return staticmethod(forward)

    def patched_backward(orig):
        def backward(ctx, *grads):
            if tracks_modules:
                before, injector.backward_module = injector.backward_module, getattr(ctx, "ttrace_module", "")
            try:
                with injector:
                    return orig.__func__(ctx, *grads)
            finally:
                if tracks_modules:
                    injector.backward_module = before
        return staticmethod(backward)
    try:
        for f, (fwd, bwd) in saved.items():
            f.forward, f.backward = patched_forward(fwd), patched_backward(bwd)
        yield
    finally:
        for f, (fwd, bwd) in saved.items():
            f.forward, f.backward = fwd, bwd


def _wrap_norm_params(args: tuple, kwargs: dict, fns: dict[int, Callable]) -> tuple[tuple, dict]:
    """``F.layer_norm``/``F.rms_norm`` arguments with weight (position 2) and bias (3), given
    positionally or by keyword, wrapped to get gradient noise."""
    names = {2: "weight", 3: "bias"}
    args, kwargs = list(args), dict(kwargs)
    for pos, fn in fns.items():
        if len(args) > pos:
            args[pos] = _PerturbGrad.apply(args[pos], fn)
        elif names[pos] in kwargs:
            kwargs[names[pos]] = _PerturbGrad.apply(kwargs[names[pos]], fn)
    return tuple(args), kwargs


@dataclass
class Propagation:
    """Largest deviation per named tensor over the noisy samples, and the clean values."""

    deviation: dict[str, torch.Tensor]
    clean: dict[str, torch.Tensor]
    samples: int
    perturbed_ops: int = 0
    per_sample_max: dict[str, list[float]] = field(default_factory=dict)


def measure_propagation(run: Callable[[], dict[str, torch.Tensor]], samples: int = 4, seed: int = 0,
                        **injector_kwargs) -> Propagation:
    """Run ``run()`` once clean and ``samples`` times under a :class:`NoiseInjector`.

    ``run`` must be deterministic apart from the injected noise (same weights, same data)
    and returns the tensors to watch, e.g. ``{"out": y, "grad.fc1.weight": fc1.weight.grad}``.
    Returns the elementwise max deviation from the clean run per name. ``injector_kwargs``
    go to :class:`NoiseInjector` (e.g. ``mode="probabilistic", calibration="e4m3.json"``).
    """
    clean = {k: v.detach().double().clone() for k, v in run().items()}
    dev = {k: torch.zeros_like(v) for k, v in clean.items()}
    per = {k: [] for k in clean}
    g = torch.Generator().manual_seed(seed)
    perturbed = 0
    for _ in range(samples):
        inj = NoiseInjector(g, **injector_kwargs)
        with inj:
            noisy = run()
        perturbed = inj.perturbed
        for k, v in noisy.items():
            d = (v.detach().double() - clean[k]).abs()
            dev[k] = torch.maximum(dev[k], d)
            per[k].append(float(d.max()))
    return Propagation(dev, clean, samples, perturbed, per)
