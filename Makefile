# SPDX-License-Identifier: Apache-2.0
# The two commands of the README, and the steps under them.
#   make demo   the main job: builds, then runs the demo on the GPU or the emulated device
#   make test   installs what is missing, configures, builds from scratch if needed, runs ctest
# PRESET=debug|release|asan|tsan picks another CMakePresets.json preset (default: default).

PRESET ?= default
BUILD  := build/$(PRESET)
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all setup configure build test demo bench test-asan test-tsan gpu-check clean

all: build

setup:
	@bash tools/setup

configure: setup
	cmake --preset $(PRESET)

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

demo: build
	$(BUILD)/samples/device_tour/device_tour

MPIRUN ?= mpirun --allow-run-as-root --oversubscribe --bind-to none

bench: build
	$(BUILD)/bench/taskswap_bench --benchmark_counters_tabular=true
	$(MPIRUN) -np 2 $(BUILD)/bench/taskswap_comm_bench --benchmark_counters_tabular=true

test-asan:
	$(MAKE) test PRESET=asan

test-tsan:
	$(MAKE) test PRESET=tsan

gpu-check:
	bash tools/gpu-check

clean:
	rm -rf build
