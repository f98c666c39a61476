# Every target installs what it needs first (a fresh clone needs nothing else).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: install demo test lint bench snapshots clean

install: $(STAMP)

# torch first and pinned: torch==2.13.0 is the CPU build on this machine's disk; any other spec pulls a
# multi-GB CUDA build. DeepSpeed is an sdist whose build imports torch, so it builds against that torch.
$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation 'deepspeed==0.19.8'
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	$(VENV)/bin/orch run phi3_dpo_fsdp --local --nodes 2 --smoke --fresh

test: install
	SKYPILOT_DISABLE_LOCAL_API_SERVER=1 $(PY) -m pytest $(PYTEST_ARGS)

bench: install
	SKYPILOT_DISABLE_LOCAL_API_SERVER=1 $(PY) bench/run.py

# The launch side's snapshots of the installed training stack (TRL's arguments and profiles, accelerate's keys).
snapshots: install
	$(PY) -m orchestrator.train.snapshots

lint: install
	$(VENV)/bin/ruff check orchestrator tests bench

clean:
	rm -rf $(VENV) outputs .pytest_cache
