"""Process-wide shim that lets megatron-core 0.16.1 run on CPU with gloo.

Call :func:`install` once per process (e.g. at the top of a gloo worker) before building a
megatron model. It is idempotent. It must never be imported by the library
(``ttrace_num``/``tracer``): it rewrites ``torch.cuda`` functions and enters a
``TorchFunctionMode`` for the whole process, which is only acceptable in a CPU harness.

What it removes (megatron-core 0.16.1, measured; see ../shared/platform.md):

* :func:`apply`: ``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed``/
  ``current_device`` and megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state``
  (tensor_parallel/random.py, GlobalMemoryBuffer, mappings, rotary embedding).
* :func:`allow_sequence_parallel_torch_norm`: ``WrappedTorchNorm`` asserts
  ``not config.sequence_parallel``; the patch builds the norm with SP off and then tags its
  parameters ``sequence_parallel=True`` so that ``finalize_model_grads`` all-reduces their
  (partial, per sequence shard) grads over the TP group.
* :func:`redirect_cuda_to_cpu`: ``device="cuda"`` in the pipeline schedules, ``.cuda()`` on
  the tied embedding when PP>1, and ``device='cuda'`` tensors in the megatron optimizer.
"""
from __future__ import annotations

import torch

__all__ = [
    "allow_sequence_parallel_torch_norm",
    "apply",
    "install",
    "installed",
    "redirect_cuda_to_cpu",
]

_STATE: dict = {"installed": False, "mode": None}


def apply() -> None:
    """Map the torch.cuda RNG/device helpers that megatron calls onto the CPU ones."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed calls torch.cuda.manual_seed_all: it must not recurse
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    import megatron.core.tensor_parallel.random as mr

    def _get(device="cuda", clone=False, graph_safe=False):
        s = torch.get_rng_state()
        return s.clone() if clone else s

    def _set(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mr._get_cuda_rng_state = _get
    mr._set_cuda_rng_state = _set


def allow_sequence_parallel_torch_norm() -> None:
    """Let ``WrappedTorchNorm`` (local spec) be built under sequence parallelism.

    Its parameters are tagged ``sequence_parallel`` so that ``finalize_model_grads``
    all-reduces their grads over the tensor-parallel group (each TP rank only saw its
    sequence shard). Untagging them afterwards is a ready-made negative control.
    """
    import megatron.core.transformer.torch_norm as tn
    if getattr(tn.WrappedTorchNorm, "_ttrace_cpu_shim", False):
        return
    orig_new = tn.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kw):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            mod = orig_new(cls, config, hidden_size, eps, **kw)
        finally:
            config.sequence_parallel = sp
        for p in mod.parameters():
            p.sequence_parallel = sp
        return mod

    tn.WrappedTorchNorm.__new__ = staticmethod(new)
    tn.WrappedTorchNorm._ttrace_cpu_shim = True


def redirect_cuda_to_cpu(fake_cuda_type_names: bool = False):
    """Enter (process-wide, never exited) a TorchFunctionMode that sends 'cuda' to 'cpu'.

    ``Tensor.cuda()`` becomes the identity; ``device=`` keyword arguments and
    ``Tensor.to(device)`` that name cuda (or a device index) are rewritten to cpu. With
    ``fake_cuda_type_names``, ``t.type()`` answers ``'torch.cuda.FloatTensor'`` etc. (the
    megatron optimizer and ``clip_grad_by_total_norm_fp32`` assert on these names).
    ``torch.cuda.synchronize`` becomes a no-op. Returns the mode object.
    """
    from torch.overrides import TorchFunctionMode

    def fix(d):
        if isinstance(d, str) and d.startswith("cuda"):
            return "cpu"
        if isinstance(d, torch.device) and d.type == "cuda":
            return torch.device("cpu")
        if isinstance(d, int) and not isinstance(d, bool):
            return "cpu"
        return d

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and fake_cuda_type_names:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            if "device" in kwargs:
                kwargs["device"] = fix(kwargs["device"])
            if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                    and not isinstance(args[1], bool):
                args = (args[0], fix(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    mode = _CudaToCpu()
    mode.__enter__()  # process-wide
    torch.cuda.synchronize = lambda *a, **k: None
    return mode


def install() -> None:
    """Apply everything the CPU harness needs; a second call does nothing."""
    if _STATE["installed"]:
        return
    apply()
    allow_sequence_parallel_torch_norm()
    _STATE["mode"] = redirect_cuda_to_cpu(fake_cuda_type_names=True)
    _STATE["installed"] = True


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _STATE["installed"]
