"""Framework adapters: what an integration provides (tracer.adapters.base), one module per framework."""
