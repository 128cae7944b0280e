# SPDX-License-Identifier: Apache-2.0
# The two commands of the README, and the steps under them.
#   make demo   the main job: builds, trains the sample multi-task model, then prints the headroom
#               table (the GPU where there is one, else the emulated device)
#   make test   installs what is missing, configures, builds from scratch if needed, runs ctest
# PRESET=debug|release|asan|tsan picks another CMakePresets.json preset (default: default).

PRESET ?= default
BUILD  := build/$(PRESET)
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all setup configure build test demo smoke bench test-asan test-tsan fuzz gpu-check clean

all: build

setup:
	@bash tools/setup

configure: setup
	cmake --preset $(PRESET)

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

# The sample trainer, then the headroom report on the embedded default configuration: the GPU's
# (samples/configs/cuda.toml) where nvidia-smi lists one, else the emulated device's.
DEMO_CONFIG ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo samples/configs/cuda.toml || echo samples/configs/emulated.toml)

demo: build
	$(BUILD)/samples/multitask/multitask_train $(DEMO_CONFIG)
	$(BUILD)/tools/taskswap headroom

# A smoke run of a build without its tests (CI runs it on the release preset): the target
# `programs` (all but the tests), then the sample trains a few steps on the emulated device and the
# planner plans the demo configuration.
smoke: configure
	cmake --build --preset $(PRESET) -j $(JOBS) --target programs
	$(BUILD)/samples/multitask/multitask_train samples/configs/emulated.toml --steps 100
	$(BUILD)/tools/taskswap plan samples/configs/emulated.toml

MPIRUN ?= mpirun --allow-run-as-root --oversubscribe --bind-to none

bench: build
	$(BUILD)/bench/taskswap_bench --benchmark_counters_tabular=true
	$(MPIRUN) -np 2 $(BUILD)/bench/taskswap_comm_bench --benchmark_counters_tabular=true

test-asan:
	$(MAKE) test PRESET=asan

test-tsan:
	$(MAKE) test PRESET=tsan

# The libFuzzer harnesses (config loader, checkpoint manifest reader), FUZZ_SECONDS each.
FUZZ_SECONDS ?= 60
fuzz: setup
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS)
	bash fuzz/run $(FUZZ_SECONDS)

gpu-check:
	bash tools/gpu-check

clean:
	rm -rf build
