# Two commands do all the set-up: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.m2flow-installed
# Every install goes through the lock file: the exact versions the suite last passed with.
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: setup demo check test bench lock clean vulkan

setup: $(STAMP)

# torch is pinned to the CPU build on disk and installed first, so nothing pulls a CUDA build.
# The maniskill extra (ManiSkill3 tasks) comes with the test set-up; SAPIEN needs a Vulkan device (`make vulkan`).
# Meta-World without its dependencies: it pins mujoco==3.3.0, this project runs MuJoCo 4 (see
# m2flow/embodied/envs/metaworld.py).
$(STAMP): pyproject.toml constraints.txt scripts/vulkan.sh
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,maniskill]"
	$(PIP) --no-deps metaworld==3.1.1
	bash scripts/vulkan.sh
	touch $(STAMP)

# Debian 12: Mesa's software Vulkan driver from bookworm-backports, for ManiSkill3 (root or sudo). Elsewhere: a hint.
vulkan:
	bash scripts/vulkan.sh

demo: setup
	$(VENV)/bin/m2flow demo

# The fast tier, for the development loop: the unit and runtime tiers but their tests marked slow, and one short run
# of each flow (the reasoning flow's GRPO steps collocated and pipelined, the CartPole PPO preset to a return of 475).
CHECK_FLOWS := tests/e2e/test_reasoning_flow.py::test_grpo_steps_train_and_sync \
	tests/e2e/test_embodied_flow.py::test_cartpole_ppo_preset_reaches_475
check: setup
	$(PY) -m pytest -q -m "not slow" --durations=5 tests/unit tests/runtime $(CHECK_FLOWS)

# Every failure of a run is shown (no -x), then the 15 slowest tests.
test: setup
	$(PY) -m pytest -q --durations=15 tests

bench: setup
	$(PIP) -e ".[test,bench]"

# Refresh the lock deliberately: resolve the newest releases pyproject.toml's ranges admit in a scratch venv
# and write them to constraints.txt (its comment header is kept). Then `make test`; commit both if it passes.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/pip install -q -e ".[test,bench,maniskill]"
	{ grep '^#' constraints.txt; $(LOCK_VENV)/bin/pip freeze --all --exclude-editable | grep -v '^pip=='; } \
		> constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV) $(STAMP)

clean:
	rm -rf runs/ .pytest_cache
