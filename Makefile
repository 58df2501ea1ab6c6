# Set-up and everyday commands. `make demo` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Pinned torch first: a CPU build from local disk here; an unpinned 'torch' may pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install demo test bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/demo.py

# Three pytest processes (pytest-xdist) on a 2-core machine: the suite waits on children, servers,
# kills and timeouts as much as it computes, and a third process fills those waits (quiet, 2 cores:
# 176 s against 200 s with two). The tests sharing the torchrun launches go to one process, and the
# longest tests start first (tests/conftest.py). TEST_WORKERS=N to compare.
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m packio.bench

# For GPU machines: the GPU decode extras, torch held at its installed version (so pip picks the
# torchvision built for it) and nvImageCodec for its CUDA major; then every GPU figure (gpu-out/gpu-run.md).
TORCH_NOW = $(PY) -c 'import torch; print(torch.__version__.split("+")[0])'
NVIMG_EXTRA = $(PY) -c 'import torch; print("nvimgcodec-cu13" if (torch.version.cuda or "").startswith("13") else "nvimgcodec")'
gpu-check: install
	$(PY) -m pip install -q -e ".[gpu,$$($(NVIMG_EXTRA))]" "torch==$$($(TORCH_NOW))"
	$(PY) tools/gpu_run.py --out gpu-out

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-out
