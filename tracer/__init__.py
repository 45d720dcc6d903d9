"""The tracer: record a reference and a candidate run, compare them, report the first divergence.

The package is laid out by job, one sub-package each:

* :mod:`tracer.trace` -- the trace itself: its schema (:mod:`tracer.trace.schema`: phases, record
  keys, entries, statuses), storage on disk (safetensors + JSON manifests), the statistics of a
  traced tensor, and the canonical mapping of shards to full tensors.
* :mod:`tracer.capture` -- recording: module hooks (:mod:`tracer.capture.hooks`), the reference's
  noise samples, re-synchronised references, an optimizer's state.
* :mod:`tracer.adapters` -- one module per training framework (megatron-core, plain PyTorch
  DDP), each implementing the adapter protocol of :mod:`tracer.adapters.base`.
* :mod:`tracer.compare` -- the comparison: which records are compared (:mod:`tracer.compare.check`),
  the verdict on one tensor (:mod:`tracer.compare.judge`), thresholds, localisation.
* :mod:`tracer.report` -- what a user reads: terminal summary, JSON, plot.

:mod:`tracer.errors` holds the errors every part raises; :mod:`tracer.cli` the ``ttrace`` command.
"""
