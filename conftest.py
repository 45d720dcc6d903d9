# Repository-root conftest: makes `examples` and `bench` importable from tests.
