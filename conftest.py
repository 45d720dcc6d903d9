"""Repository-root conftest: makes `examples` and `bench` importable from tests, and keeps
each pytest worker on one thread (`make test` runs two workers on two cores)."""
import torch

torch.set_num_threads(1)
