# One virtual environment at .venv/; every target uses it.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test lint typecheck format serve clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch (with its torchvision) is installed first, alone and pinned, so no other torch build is
# ever pulled in. 2.14.1 is PyPI's CUDA build: the same torch on CPU and GPU machines; on a
# machine without a GPU it runs on the CPU (the venv is about 5.5 GB, most of it CUDA libraries).
setup: $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(VPY) -m pip install -q -e ".[serve,dev]"

# pytest-xdist workers: the modules that start Ray run in two units of one worker each, and
# every other module is a unit of its own, run at a lower CPU priority (nice) so the Ray units,
# the critical path, are served first (tests/xdist_units.py). TEST_WORKERS=0: serially.
TEST_WORKERS ?= 3
test:
	@test -x $(VPY) || $(MAKE) setup
	$(VPY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: typecheck
	$(VPY) -m ruff check shortconv workers deployments tests bench
	$(VPY) -m ruff format --check shortconv workers deployments tests bench

# mypy over the shipped packages (configured in pyproject.toml's [tool.mypy]); the count of
# `# type: ignore` comments is printed on every run so a new one is seen in review.
TYPED_PKGS := shortconv workers deployments
typecheck:
	@echo "type: ignore comments in $(TYPED_PKGS): $$(grep -rn --include='*.py' '# type: ignore' $(TYPED_PKGS) | wc -l)"
	$(VPY) -m mypy

format:
	$(VPY) -m ruff format shortconv workers deployments tests bench
	$(VPY) -m ruff check --fix shortconv workers deployments tests bench

serve:
	@test -x $(VPY) || $(MAKE) setup
	$(VENV)/bin/serve run deployments/zaya1.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
