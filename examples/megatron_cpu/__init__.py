"""Real megatron-core 0.16.1 GPTModel training on CPU under gloo (harness only).

``shim`` patches torch.cuda / megatron-core process-wide so megatron runs on CPU; ``gpt``
builds and trains a tiny GPTModel for a given parallel layout. Nothing in ``ttrace_num`` or
``tracer`` imports this package: the shim is for the CPU harness (tests, demos, benchmarks),
never for what a GPU user imports. Importing this package does not apply the shim.
"""
