# Every target installs what it needs first (a fresh clone needs nothing else).
VENV   ?= .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
UV_TMP := $(abspath $(VENV))/tmp
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile uv.lock | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
# pytest-xdist workers: the suite is CPU-bound (every smoke run imports the training stack in 2 ranks) and one pytest
# process kept ~1.4 of this machine's 2 cores busy. Tests go to whichever worker is free, but a module with a
# module-scoped fixture (rehearsals, the Slurm cluster) is one xdist_group, run by one worker.
PYTEST_WORKERS ?= 2
# The tests' environment: no local SkyPilot API server unless a test starts its own (the bed), and Python's bytecode
# kept for this checkout's own code (orchestrator/, tests/), as a user's shell keeps it: this machine sets
# PYTHONDONTWRITEBYTECODE=1, so every orch, accelerate and rank process the suite starts compiled orch's modules from
# source and each xdist worker rewrote every test module's asserts again (measured: test-fast 61.4 s -> 57.2 s).
TEST_ENV := PYTHONDONTWRITEBYTECODE= SKYPILOT_DISABLE_LOCAL_API_SERVER=1

.PHONY: install demo test test-fast lint bench gpu-check snapshots lock clean sky-bed

install: $(STAMP)

# Exactly uv.lock's versions, as the nodes get them (scripts/node-setup.sh), with uv. torch first, with pip:
# torch==2.13.0 (the lock's) is the CPU build on this machine's disk, which uv does not see; any other source pulls
# a multi-GB CUDA build, so torch's tree is pruned from the export. DeepSpeed is an sdist whose build imports
# torch: it builds against that torch, without isolation. Then the .pyc files, once: uv writes none and this machine
# sets PYTHONDONTWRITEBYTECODE=1, so every process would compile transformers, peft and SkyPilot from source again
# (measured: an orch dry run 13.9 s -> 6.4 s, a training rank's imports 19.5 s -> 13 s of CPU). uv's temporary files
# go to $(VENV)/tmp: it keeps a lock file per build environment there (uv-setuptools-*.lock, by design: astral-sh/uv
# #11878), one more in the machine's /tmp at every fresh clone's install. orch itself is installed editable as a plain
# path in a .pth (setuptools' compat mode): its default, an import finder, imported pathlib, re and importlib.util
# into every Python process of this environment before its first line (`python -c pass` 40 -> 10-20 ms here,
# 2026-12-02; the suite starts thousands of them).
$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q setuptools wheel uv==0.13.9 torch==2.13.0
	$(UV) export -q --frozen --no-emit-project --prune torch --extra dev --format requirements-txt -o $(VENV)/requirements.txt
	mkdir -p $(UV_TMP)
	TMPDIR=$(UV_TMP) $(UV) pip install -q --python $(PY) --no-deps --require-hashes --no-build-isolation-package deepspeed -r $(VENV)/requirements.txt
	TMPDIR=$(UV_TMP) $(UV) pip install -q --python $(PY) --no-deps -e . -C editable_mode=compat
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: install
	$(VENV)/bin/orch run phi3_dpo_fsdp --local --nodes 2 --smoke --fresh

test: install
	$(TEST_ENV) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The inner loop (60-90 s here on 2026-12-02, 42-47 s on 2026-12-05): the unit and cli tiers (tests/conftest.py; what each tier means:
# pyproject.toml), the fuzz harness at 300 examples (make test runs its 2000).
test-fast: install
	ORCH_FUZZ_EXAMPLES=300 $(TEST_ENV) $(PY) -m pytest -n $(PYTEST_WORKERS) --tier unit,cli -q -p no:cacheprovider $(PYTEST_ARGS)

# Real SkyPilot without a cloud (root): a 2-node Slurm cluster in network namespaces with a login node and SkyPilot's
# API server (tests/sky_bed.py); prints the commands to try and takes it all down when you press Enter.
sky-bed: install
	cd tests && ../$(PY) sky_bed.py

bench: install
	SKYPILOT_DISABLE_LOCAL_API_SERVER=1 $(PY) bench/run.py

# On a machine with CUDA GPUs: each strategy's smoke recipe for real (bf16, NCCL, save, resume, final model), then
# tokens/s and MFU of the SFT recipe's settings vs TRL's defaults, packed attention, the fused LM head's memory.
# Record what it prints in docs/gpu.md.
gpu-check: install
	SKYPILOT_DISABLE_LOCAL_API_SERVER=1 $(PY) bench/gpu_check.py

# The launch side's snapshots of the installed training stack (TRL's arguments and profiles, accelerate's keys).
snapshots: install
	$(PY) -m orchestrator.train.snapshots
	$(PY) -c 'from orchestrator.core.sky_schema import SCHEMA; from orchestrator.launch.backends import sky; \
		SCHEMA.write_text(sky.task_schema_text()); print("wrote", SCHEMA)'

# Re-resolve uv.lock (pins in pyproject.toml hold; the rest moves to the newest that fits), reinstall from it and
# regenerate the snapshots from what it installed: the lock and the snapshots change together.
lock:
	$(UV) lock --upgrade
	$(MAKE) snapshots

lint: install
	$(VENV)/bin/ruff check orchestrator tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) outputs .pytest_cache
