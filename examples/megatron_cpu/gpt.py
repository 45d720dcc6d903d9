"""Build and train a tiny megatron-core GPTModel for one parallel layout, inside a gloo worker.

    from examples.gloo import run_gloo
    from examples.megatron_cpu.gpt import build_and_train

    def work(rank, world):
        return build_and_train({"tp": 2, "pp": 2, "dp": 1, "sp": True, "distopt": False},
                               steps=3, seed=1234)

    per_rank = run_gloo(work, 4)

Every layout starts from the same full weights and sees the same global batch, so losses and
grad norms are comparable across layouts (fp32: they agree to ~1e-6 relative):

* ``use_cpu_initialization=True``: each TP-split weight is drawn in full, then split.
* ``init_method``/``output_layer_init_method`` draw from a generator seeded by ``seed`` and the
  full weight's shape, so a PP stage gets the same weights as the single-device model (layers
  with the same shapes share initial values; that is harmless here).
* One global batch (``batch_seed``) of ``global_batch`` sequences; DP rank r gets the r-th
  contiguous slice, split into micro batches of ``micro_batch`` sequences.
* The reported loss per step is the mean over the global batch: the last PP stage's mean over
  its micro batches, averaged over DP, then sent to every rank.
"""
from __future__ import annotations

import contextlib
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from examples.gloo import released_groups

__all__ = ["DEFAULT_MODEL", "build_and_train", "layout_name"]

DEFAULT_MODEL: dict[str, Any] = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                     "ffn_hidden_size": 256, "vocab_size": 128, "seq_length": 32}


def layout_name(layout: dict) -> str:
    """Short name such as ``tp2.pp2.dp1+sp`` (``+vpp2`` with 2 virtual pipeline chunks per stage,
    ``+distopt`` when the distributed optimizer is on)."""
    s = f"tp{layout.get('tp', 1)}.pp{layout.get('pp', 1)}.dp{layout.get('dp', 1)}"
    if layout.get("sp"):
        s += "+sp"
    if int(layout.get("vpp", 1)) > 1:
        s += f"+vpp{int(layout['vpp'])}"
    if layout.get("distopt"):
        s += "+distopt"
    return s


def _shape_keyed_init(seed: int, std: float):
    """An init method whose values depend only on ``seed`` and the (full) tensor's shape."""
    def init(t: torch.Tensor) -> torch.Tensor:
        key = zlib.crc32(repr(tuple(t.shape)).encode()) ^ (seed * 2654435761 % 2**32)
        g = torch.Generator().manual_seed(key)
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std)
        return t
    return init


def _named_parameters(chunks: list) -> list:
    """``(name, param)`` over a rank's model chunks (one chunk without virtual pipelining)."""
    return [(f"{i}.{n}" if len(chunks) > 1 else n, p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]


def _digest(chunks: list) -> str:
    """SHA-256 of this rank's parameters' bytes (bitwise comparison of runs)."""
    import hashlib
    h = hashlib.sha256()
    for name, p in _named_parameters(chunks):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rerun(model, rerun: dict, dtype: str):
    """Re-run one module of this (single-process) model on the candidate's inputs."""
    from tracer.compare.localise import rerun_module
    from tracer.adapters.megatron import noise_policy, unwrap
    modules = dict(unwrap(model).named_modules())
    if rerun["module"] not in modules:
        raise ValueError(f"no module {rerun['module']!r} in the reference model")
    return rerun_module(modules[rerun["module"]], rerun["module"], rerun["args"], rerun["kwargs"], rerun["output"],
                        policy=noise_policy(int(rerun.get("noise_tp", 2)), dtype))


def _resync(model, optimizer, candidate: str, step: int) -> None:
    """Load the candidate's state at the end of ``step`` into this (single-process) run."""
    from tracer.adapters.megatron import unwrap
    from tracer.capture.resync import candidate_state, load_state
    load_state(optimizer, list(unwrap(model).named_parameters()), candidate_state(candidate, step))


def _signature(sizes: dict, seed: int, dtype: str, global_batch: int) -> str:
    """What must agree for two traces to be comparable: model sizes, seeds, batch, dtype."""
    return "megatron-gpt:" + ",".join(f"{k}={v}" for k, v in sorted(sizes.items())) + \
        f",seed={seed},global_batch={global_batch},dtype={dtype}"


def _global_batch(seed: int, global_batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def build_and_train(layout: dict, steps: int = 3, seed: int = 1234, dtype: str = "fp32", *,
                    global_batch: int = 4, micro_batch: int = 1, lr: float = 1e-3,
                    clip_grad: float = 1.0, batch_seed: int | None = None,
                    untag_sp_norm: bool = False, zero_grad_of: str | None = None,
                    zero_grad_rank: int = 0, trace: dict | None = None, bug: str | None = None,
                    rerun: dict | None = None,
                    **config_overrides: Any) -> dict:
    """Build the tiny GPT for ``layout``, train ``steps`` Adam steps, return this rank's record.

    Call inside a gloo worker (``torch.distributed`` initialised, world = tp*pp*dp).

    Args:
        layout: ``{"tp": int, "pp": int, "dp": int, "sp": bool, "distopt": bool, "vpp": int}``;
            ``vpp > 1``: that many virtual pipeline chunks per stage (megatron's interleaved
            schedule; ``num_layers`` must be a multiple of ``pp * vpp``).
        steps: optimizer steps.
        seed: weight-init seed (same for every layout).
        dtype: ``"fp32"`` or ``"bf16"`` (bf16 params/compute, fp32 main params and grads).
        global_batch, micro_batch: sequences per step (whole job) and per micro batch.
        lr, clip_grad: Adam learning rate and grad-norm clip.
        batch_seed: seed of the global batch (default ``seed + 1``).
        untag_sp_norm: negative control: drop the ``sequence_parallel`` tag of the norm
            params, so their grads are not all-reduced over TP under SP (wrong grads).
        zero_grad_of, zero_grad_rank: negative control: on global rank ``zero_grad_rank``,
            zero the main grad of every param whose name contains ``zero_grad_of`` after the
            backward pass and before ``finalize_model_grads`` (before DP/TP reduction).
        trace: trace the run with :class:`tracer.adapters.megatron.MegatronTracer`: ``{"root": dir,
            "mode": "full"|"stats", "noise_samples": S, "noise_tp": T, "noise_seed": k,
            "noise_store": "moments"|"tensors"}``.
            ``noise_samples > 0`` (single-process reference only) also runs every step ``S``
            times under ``ttrace_num``'s noise injector, from the same state, into
            ``root/noise/sample_<i>`` (see :mod:`examples.megatron_cpu.traced`), stored as
            deviation moments (default) or whole (:class:`tracer.capture.noise_sampler.NoiseSampler`).
        bug: name of a bug from :mod:`examples.megatron_cpu.bugs` to inject into this run.
        rerun: localisation (single process only): ``{"step": t, "module": canonical name,
            "args": [...], "kwargs": {...}, "output": candidate's output, "noise_tp": T}``:
            train up to step ``t``, then re-run that module of this (reference) model on the
            candidate's inputs (:func:`tracer.compare.localise.rerun_module`) and return the verdict
            as ``result["rerun"]`` instead of training step ``t``; with ``"resync_from":
            candidate trace``, step ``t`` starts from the candidate's state (:mod:`tracer.capture.resync`).
        config_overrides: model sizes (``DEFAULT_MODEL`` keys) or ``TransformerConfig`` fields.

    Returns:
        dict with ``rank``, ``world``, ``layout`` (with ``name``), ``ranks`` (tp/pp/dp rank),
        ``losses`` (list of 0-d fp32 tensors, global-batch mean per step, on every rank),
        ``grad_norms`` (list of floats from the optimizer, global over the model),
        ``step_s`` (seconds per step), ``build_s``, ``num_microbatches``.
    """
    from examples.megatron_cpu import shim
    shim.install()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    tp, pp, dp = int(layout.get("tp", 1)), int(layout.get("pp", 1)), int(layout.get("dp", 1))
    sp, distopt = bool(layout.get("sp", False)), bool(layout.get("distopt", False))
    vpp = int(layout.get("vpp", 1))
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp * pp * dp != world:
        raise ValueError(f"layout {layout} needs world {tp * pp * dp}, got {world}")
    if sp and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    bf16 = dtype == "bf16"
    params_dtype = torch.bfloat16 if bf16 else torch.float32
    sizes = dict(DEFAULT_MODEL)
    for k in list(config_overrides):
        if k in sizes:
            sizes[k] = config_overrides.pop(k)
    if global_batch % (dp * micro_batch):
        raise ValueError("global_batch must be a multiple of dp * micro_batch")
    local_batch = global_batch // dp
    num_mb = local_batch // micro_batch
    if vpp > 1 and (pp == 1 or sizes["num_layers"] % (pp * vpp) or num_mb % pp):
        raise ValueError(f"vpp={vpp} needs pp > 1, num_layers ({sizes['num_layers']}) a multiple of pp * vpp and "
                         f"the microbatches per rank ({num_mb}) a multiple of pp")
    seq = sizes["seq_length"]

    t0 = time.perf_counter()
    undo_bug = traced = None
    ps.destroy_model_parallel()
    groups = contextlib.ExitStack()  # megatron's process groups end with this run
    groups.enter_context(released_groups())
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        cfg_kw = {
            "num_layers": sizes["num_layers"], "hidden_size": sizes["hidden_size"],
            "num_attention_heads": sizes["num_attention_heads"], "ffn_hidden_size": sizes["ffn_hidden_size"],
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "sequence_parallel": sp,
            "use_cpu_initialization": True, "perform_initialization": True,
            "init_method": _shape_keyed_init(seed, 0.02),
            "output_layer_init_method": _shape_keyed_init(seed + 7, 0.02 / (2 * sizes["num_layers"]) ** 0.5),
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "bias_activation_fusion": False,
            "masked_softmax_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False, "params_dtype": params_dtype, "bf16": bf16,
            "pipeline_dtype": params_dtype, "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
            # with 2 stages each rank's previous and next stage are the same peer: batched
            # isend/irecv then pair a forward activation with a backward gradient of the same
            # shape on gloo (silently wrong from the (pp+1)-th microbatch on); megatron's
            # unbatched ops order the pairs by rank parity
            "batch_p2p_comm": not (vpp > 1 and pp == 2)}
        cfg_kw.update(config_overrides)
        config = TransformerConfig(**cfg_kw)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distopt, bucket_size=None)
        chunks = []
        for vp in range(vpp):  # one model chunk per virtual pipeline stage (one without VPP)
            stage = {"ignore_virtual": False, "vp_stage": vp} if vpp > 1 else {}
            chunk = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=sizes["vocab_size"], max_sequence_length=seq,
                             pre_process=ps.is_pipeline_first_stage(**stage),
                             post_process=ps.is_pipeline_last_stage(**stage),
                             parallel_output=True, share_embeddings_and_output_weights=True,
                             position_embedding_type="rope", **({"vp_stage": vp} if vpp > 1 else {}))
            if untag_sp_norm:
                norms = [p for n, p in chunk.named_parameters() if "layernorm" in n]
                if not (sp and norms):
                    raise ValueError("untag_sp_norm needs sequence parallelism and norm parameters")
                for p in norms:
                    p.sequence_parallel = False
            if bf16:
                chunk = Float16Module(config, chunk)
            chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                                  disable_bucketing=vp > 0))
        model = chunks[0] if vpp == 1 else chunks
        config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad,
                                     bf16=bf16, params_dtype=params_dtype,
                                     use_distributed_optimizer=distopt)
        optimizer = get_megatron_optimizer(opt_config, chunks)
        if zero_grad_of is not None and rank == zero_grad_rank:
            victims = [p for n, p in _named_parameters(chunks) if zero_grad_of in n]
            if not victims:
                raise ValueError(f"no parameter name contains {zero_grad_of!r}")

            def finalize(*a, **k):
                for p in victims:
                    p.main_grad.zero_()
                return finalize_model_grads(*a, **k)
            config.finalize_model_grads_func = finalize
        build_s = time.perf_counter() - t0

        tokens, labels = _global_batch(seed + 1 if batch_seed is None else batch_seed,
                                       global_batch, seq, sizes["vocab_size"])
        dp_rank = ps.get_data_parallel_rank()
        tokens = tokens[dp_rank * local_batch:(dp_rank + 1) * local_batch]
        labels = labels[dp_rank * local_batch:(dp_rank + 1) * local_batch]
        position_ids = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)
        attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        mb_losses: list[torch.Tensor] = []

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            mb_losses.append(loss.detach().clone())
            return loss, {"lm loss": loss.detach().clone()}

        def forward_step(data_iterator, model_):
            tok, lab = next(data_iterator)
            out = model_(tok, position_ids, attention_mask, labels=lab)
            return out, loss_func

        fb = get_forward_backward_func()
        losses, grad_norms, step_s = [], [], []
        last = ps.is_pipeline_last_stage()

        def forward_backward(step_fn=forward_step):
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            mb_losses.clear()
            batches = [(tokens[i * micro_batch:(i + 1) * micro_batch], labels[i * micro_batch:(i + 1) * micro_batch])
                       for i in range(num_mb)]
            its = [iter(batches) for _ in chunks]  # each chunk reads every microbatch once
            fb(forward_step_func=step_fn, data_iterator=its[0] if vpp == 1 else its, model=chunks,
               num_microbatches=num_mb, seq_length=seq, micro_batch_size=micro_batch,
               forward_only=False)
            return list(mb_losses)  # this run's microbatch losses (noise samples run the step too)

        traced = None
        if trace is not None:
            from examples.megatron_cpu.traced import TracedRun
            traced = TracedRun(trace, model, config, optimizer, layout=layout, dtype=dtype,
                               num_microbatches=num_mb, signature=_signature(sizes, seed, dtype, global_batch))
        if bug is not None:  # after the tracer: a bug acts inside the run the tracer observes
            from examples.megatron_cpu.bugs import inject
            undo_bug = inject(bug, model=model, config=config, optimizer=optimizer)
        verdict = None
        for step in range(steps):
            if rerun is not None and step == rerun["step"]:
                if rerun.get("resync_from") and step > 0:
                    _resync(model, optimizer, rerun["resync_from"], step - 1)
                verdict = _rerun(model, rerun, dtype)
                break
            ts = time.perf_counter()
            if traced is None:
                step_losses = forward_backward()
                _ok, gnorm, _ = optimizer.step()
            else:
                gnorm, step_losses = traced.step(step, forward_backward, forward_step)
            step_s.append(time.perf_counter() - ts)
            loss = torch.stack(step_losses).mean() if (last and step_losses) else torch.zeros(())
            loss = loss.float()
            dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            losses.append((loss / dp).detach().clone())
            grad_norms.append(float(gnorm) if gnorm is not None else float("nan"))
        return {"rank": rank, "world": world, "layout": {**layout, "name": layout_name(layout)},
                "ranks": {"tp": ps.get_tensor_model_parallel_rank(),
                          "pp": ps.get_pipeline_model_parallel_rank(), "dp": dp_rank},
                "losses": losses, "grad_norms": grad_norms, "step_s": step_s, "build_s": build_s,
                "num_microbatches": num_mb, "dtype": dtype,
                "trace": traced.summary() if traced is not None else None, "rerun": verdict,
                "param_digest": _digest(chunks)}
    finally:
        if traced is not None:
            traced.close()
        if undo_bug is not None:
            undo_bug()
        ps.destroy_model_parallel()
        groups.close()
