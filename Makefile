# The two commands of the README: `make demo` (the main job on embedded defaults) and `make test`.
# Each sets itself up: Debian packages, a virtualenv in .venv (the project, editable, with the trainer
# backends), and a separate one in .venv-vllm for the vLLM server (its pins are its own), plus the tiny
# offline model the tests and demo serve.
# verl and SkyRL need Python 3.11.
PYTHON ?= $(shell command -v python3.11 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
# Slurm's daemons and munge: integration_tests/test_slurm.py runs the Slurm recipe on a real one-node cluster.
# Chromium: integration_tests/test_viewer_browser.py loads the rollout viewer in it, headless.
SYSTEM_PACKAGES := bwrap:bubblewrap redis-server:redis-server slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge mmdebstrap:mmdebstrap mksquashfs:squashfs-tools siftool:siftool umoci:umoci chromium:chromium

.PHONY: demo demo-real rollout-demo runtime-demo agent-demo test unit lint system-packages llm agent-env test-images bench openapi

# torch first, pinned: it is the CPU build on disk here, and nothing later may pull a CUDA build instead.
# verl brings torchcodec, built for another torch: it breaks transformers' model imports, so it goes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,train,verl,skyrl]'
	$(PY) -m pip uninstall -q -y torchcodec torchvision torchaudio
	touch $@

system-packages:
	scripts/system-packages.sh $(SYSTEM_PACKAGES)

llm:  # idempotent: each step checks a marker of its own
	scripts/vllm-env.sh
	.venv-vllm/bin/python scripts/build_tiny_model.py
	.venv-vllm/bin/python scripts/build_real_model.py

demo: system-packages $(VENV)/.installed llm
	$(VENV)/bin/prorl-train-cpu --out runs/cpu-grpo

demo-real: system-packages $(VENV)/.installed llm  # GRPO of the real SmolLM2-135M-Instruct on arithmetic (CPU)
	$(VENV)/bin/prorl-train-cpu --workload arithmetic --out runs/cpu-grpo-real

rollout-demo: system-packages $(VENV)/.installed llm
	$(PY) examples/quickstart/run_rollouts.py

runtime-demo: system-packages $(VENV)/.installed
	$(PY) examples/runtime_standalone/demo.py

agent-env:  # idempotent: the environment agent programs run in inside the sandboxes (/opt/prorl-agent)
	scripts/agent-env.sh

test-images: system-packages  # idempotent, cached: the Debian test images in every format (.test-images)
	scripts/test-images.sh

agent-demo: system-packages $(VENV)/.installed llm agent-env  # your own agent program through the gateway
	$(PY) examples/own_agent/run.py

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

openapi: $(VENV)/.installed  # docs/openapi/: both servers' OpenAPI documents and their readable references
	$(VENV)/bin/prorl-sandbox openapi --out docs/openapi
	$(VENV)/bin/prorl-rollout openapi --out docs/openapi

test: system-packages lint llm agent-env test-images
	PRORL_REQUIRE_BACKENDS=1 $(PY) -m pytest

unit: $(VENV)/.installed  # the fast loop: the unit tests (tests/), without the docs' blocks and the integration tests
	$(PY) -m pytest tests --ignore=tests/docs -q

bench: system-packages $(VENV)/.installed llm test-images
	$(PY) bench/bench_runtime.py --out docs/benchmarks.md
	$(PY) bench/bench_images.py --out docs/benchmarks.md
	$(PY) bench/bench_rollout.py --out docs/benchmarks.md
	$(PY) bench/bench_rollout.py --model real --out docs/benchmarks.md
	$(PY) bench/bench_decoupled.py --out docs/benchmarks.md
	$(PY) bench/bench_training.py --out docs/benchmarks.md
	$(PY) bench/bench_learning_real.py --fresh --out docs/benchmarks.md
	$(PY) bench/bench_scale_out.py --out docs/benchmarks.md
	$(PY) bench/bench_weight_update.py --out docs/benchmarks.md
	$(PY) bench/bench_weight_update_training.py --out docs/benchmarks.md
	$(PY) bench/bench_records.py --out docs/benchmarks.md
	$(PY) bench/bench_backpressure.py --out docs/benchmarks.md
