# Two entry points, both work on a fresh machine (see README):
#   make demo   -> set up .venv and run the demo
#   make test   -> set up .venv and run the test suite
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
MCORE   ?= megatron-core==0.16.1

.PHONY: demo test bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: anything unpinned pulls a multi-GB CUDA build
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev]"
	$(VPY) -m pip install -q --no-deps "$(MCORE)" packaging
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m examples.megatron_cpu.demo --out demo_out --resync

test: $(STAMP)
	$(VPY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

bench: $(STAMP)
	$(VPY) bench/bounds_table.py --write docs/bounds.md

clean:
	rm -rf $(VENV) build *.egg-info
