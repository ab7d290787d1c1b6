# ds4 -- build, default model, tests.
#
#   make                         CPU engine ./ds4 + the embedded default model models/ds4-tiny.gguf
#   make cpu                     the same
#   make cuda CUDA_ARCH=sm_90    CUDA engine ./ds4 (cuBLAS); CUDA_ARCH is required (sm_89, sm_120, ...)
#   make test                    every CPU test, the fuzz corpus replay and a short fuzzing budget,
#                                the CUDA compile+link check, GPU tests where a GPU exists, the series
#   make test-quick              the inner loop: C tests and the pytest files that need no oracle
#   make sanitize                malformed-input tests under -fsanitize=address,undefined
#   make clean

CC      ?= cc
NVCC    ?= nvcc
CFLAGS  ?= -O2 -g
CFLAGS  += -std=c11 -Wall -Wextra -Wno-unused-parameter -pthread
LDLIBS  += -lm -lpthread
PYTHON  ?= python3
CUDA_HOME ?= /usr/local/cuda
B       := build

CORE_SRC := ds4.c ds4.h ds4_msg.h ds4_gguf.h ds4_gpu.h ds4_hooks.h ds4_quant.h ds4_tok.h
SYNTH_SRC := ds4_synth.c ds4.h ds4_gguf.h ds4_gpu.h ds4_quant.h ds4_tok.h
HOOKS_SRC := ds4_hooks.c ds4.h ds4_gguf.h ds4_gpu.h ds4_hooks.h
QUANT_SRC := ds4_quant.c ds4_quant.h ds4_quant_tables.h ds4_gpu.h
TOK_SRC := ds4_tok.c ds4_tok.h ds4_unicode.h ds4_msg.h
MSG_SRC := ds4_msg.c ds4_msg.h

.PHONY: all cpu cuda cuda-check test test-c test-py test-gpu sanitize clean models stream-check series-check

all: cpu

cpu: ds4-cpu-build models/ds4-tiny.gguf

ds4-cpu-build: $(B)/cpu/ds4
	cp $(B)/cpu/ds4 ds4
	@echo "built ./ds4 (CPU backend)"

# The engine's C objects, one rule for both builds: build/cpu/X.o and build/cuda-ARCH/X.o from
# X.c (the CUDA build's with -DDS4_CUDA), each with the sources it includes.
define C_OBJ
$(B)/cpu/$(1).o: $(2)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS) -c $(1).c -o $$@
$(B)/cuda-%/$(1).o: $(2)
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CUDA_CFLAGS) -c $(1).c -o $$@
endef
$(eval $(call C_OBJ,ds4,$(CORE_SRC)))
$(eval $(call C_OBJ,ds4_synth,$(SYNTH_SRC)))
$(eval $(call C_OBJ,ds4_hooks,$(HOOKS_SRC)))
$(eval $(call C_OBJ,ds4_quant,$(QUANT_SRC)))
$(eval $(call C_OBJ,ds4_msg,$(MSG_SRC)))
$(eval $(call C_OBJ,ds4_tok,$(TOK_SRC)))
$(eval $(call C_OBJ,ds4_cli,ds4_cli.c ds4.h ds4_gpu.h))
$(eval $(call C_OBJ,ds4_collect,ds4_collect.c ds4.h ds4_gpu.h ds4_hooks.h ds4_tok.h ds4_msg.h))

$(B)/cpu/ds4: $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o $(B)/cpu/ds4_cli.o $(B)/cpu/ds4_collect.o
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# The embedded default model: written by the build, never downloaded.
models/ds4-tiny.gguf: $(B)/cpu/ds4
	@mkdir -p models
	$(B)/cpu/ds4 synth --config tiny --seed 1 --vocab -o $@

models: models/ds4-tiny.gguf

# ---- CUDA ----
# Never guess the GPU architecture: say what is built, and how to change it.
cuda:
	@if ! command -v $(NVCC) >/dev/null 2>&1; then \
	  echo "make cuda: nvcc not found (install the CUDA toolkit or set NVCC=/path/to/nvcc)"; exit 2; fi
	@if [ -z "$(CUDA_ARCH)" ]; then \
	  echo "make cuda: set CUDA_ARCH to your GPU's architecture, e.g. make cuda CUDA_ARCH=sm_90 (H100/H200), sm_89 (L4/4090), sm_120 (RTX 50xx)"; exit 2; fi
	@echo "make cuda: building for $(CUDA_ARCH) with $$($(NVCC) --version | tail -1)"
	$(MAKE) --no-print-directory $(B)/cuda-$(CUDA_ARCH)/ds4 CUDA_ARCH=$(CUDA_ARCH)
	cp $(B)/cuda-$(CUDA_ARCH)/ds4 ds4
	$(MAKE) --no-print-directory models/ds4-tiny.gguf
	@echo "built ./ds4 (CUDA backend, $(CUDA_ARCH); --backend cpu still available)"

NVCCFLAGS ?= -O3 -std=c++17 -lineinfo
CUDA_CFLAGS = $(CFLAGS) -DDS4_CUDA

# The CUDA backend: its entry point, one translation unit per op family and the hook emitter
# (ds4_cuda_common.cuh is what they share), compiled apart so that an edit rebuilds one unit.
# Their objects go to cu/, apart from the C objects (ds4_hooks.c and ds4_hooks.cu both exist).
CUDA_UNITS := ds4_cuda ds4_cuda_norm ds4_cuda_mhc ds4_cuda_matmul ds4_cuda_gemm ds4_cuda_attn ds4_cuda_compressor \
              ds4_cuda_indexer ds4_cuda_moe ds4_hooks
CUDA_HDRS := ds4_cuda_common.cuh ds4_cuda_quant.cuh ds4_quant.h ds4_quant_tables.h ds4_gpu.h ds4_hooks.h ds4_msg.h ds4_stream.h
define CUDA_UNIT
$(B)/cuda-%/cu/$(1).o: $(1).cu $(CUDA_HDRS) $(2)
	@mkdir -p $$(dir $$@)
	$$(NVCC) $$(NVCCFLAGS) -arch=$$* -DDS4_CUDA -c $(1).cu -o $$@
endef
$(foreach u,$(filter-out ds4_cuda_matmul ds4_cuda_attn ds4_cuda_gemm,$(CUDA_UNITS)),$(eval $(call CUDA_UNIT,$(u))))
$(eval $(call CUDA_UNIT,ds4_cuda_matmul,ds4_cuda_matvec_q.cuh))
$(eval $(call CUDA_UNIT,ds4_cuda_attn,ds4_cuda_probs.cuh))

# ds4_cuda_gemm's wgmma kernel uses sm_90a's instructions (H100, H200): an sm_90 build compiles
# that unit for sm_90a and keeps compute_90 PTX (its mma.sync kernel) for the cards after them.
comma := ,
GEMM_ARCH = $(if $(filter sm_90,$(1)),-gencode arch=compute_90a$(comma)code=sm_90a \
            -gencode arch=compute_90$(comma)code=compute_90 -DDS4_WGMMA,-arch=$(1) $(if $(filter sm_90a,$(1)),-DDS4_WGMMA))
$(B)/cuda-%/cu/ds4_cuda_gemm.o: ds4_cuda_gemm.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(call GEMM_ARCH,$*) -DDS4_CUDA -c ds4_cuda_gemm.cu -o $@

# Everything a program that drives the engine links, as prerequisites of a pattern rule (% = ARCH).
ENGINE_CUDA := $(foreach o,ds4 ds4_synth ds4_hooks ds4_quant ds4_tok ds4_msg,$(B)/cuda-%/$(o).o) \
               $(foreach u,$(CUDA_UNITS),$(B)/cuda-%/cu/$(u).o)

CUDA_LIBS = -L$(CUDA_HOME)/lib64 -lcublas -lcudart $(LDLIBS) -lstdc++

$(B)/cuda-%/ds4: $(B)/cuda-%/ds4_cli.o $(B)/cuda-%/ds4_collect.o $(ENGINE_CUDA)
	$(CC) $(CFLAGS) $^ -o $@ $(CUDA_LIBS)

$(B)/cuda-%/test_backend_ops: tests/test_backend_ops.c $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. $^ -o $@ $(CUDA_LIBS)

# bench programs are C (cc); they include CUDA runtime headers (profiler bracket, events)
$(B)/cuda-%/ds4_bench: bench/ds4_bench.c $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. -I$(CUDA_HOME)/include $^ -o $@ $(CUDA_LIBS)

$(B)/cuda-%/spot_check: tests/spot_check.c $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. $^ -o $@ $(CUDA_LIBS)

$(B)/cuda-%/test_rollback: tests/test_rollback.c $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. $^ -o $@ $(CUDA_LIBS)

$(B)/cuda-%/mtp_dump: tests/mtp_dump.c $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. $^ -o $@ $(CUDA_LIBS)

$(B)/cuda-%/matvec_table: bench/matvec_table.c ds4_stream.h $(ENGINE_CUDA)
	$(CC) $(CUDA_CFLAGS) -I. -I$(CUDA_HOME)/include $(filter-out %.h,$^) -o $@ $(CUDA_LIBS)

# the quant decoders of ds4_cuda_quant.cuh, compiled for the host, against ds4_quant.c (no GPU needed)
$(B)/cuda-%/test_cuda_quant_host: tests/test_cuda_quant_host.cu ds4_cuda_quant.cuh $(QUANT_SRC)
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O2 -I. tests/test_cuda_quant_host.cu ds4_quant.c -o $@

$(B)/cuda-%/bandwidth: bench/bandwidth.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -arch=$* bench/bandwidth.cu -o $@

$(B)/cuda-%/mma_peak: bench/mma_peak.cu bench/bench_util.h
	@mkdir -p $(dir $@)
	$(NVCC) -O3 $(call GEMM_ARCH,$*) bench/mma_peak.cu -o $@

$(B)/cuda-%/l2_read: bench/l2_read.cu bench/bench_util.h
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -arch=$* bench/l2_read.cu -o $@

$(B)/cuda-%/launch_floor: bench/launch_floor.cu
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -arch=$* bench/launch_floor.cu -o $@

$(B)/cuda-%/spin_wait: bench/spin_wait.cu bench/bench_util.h
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -arch=$* bench/spin_wait.cu -o $@ -lpthread

# keep the per-architecture objects: the test and bench programs link them too
.SECONDARY:

# CI has nvcc and cuBLAS but no GPU: compile and link everything for sm_90.
CHECK_ARCH ?= sm_90
cuda-check:
	@if ! command -v $(NVCC) >/dev/null 2>&1; then echo "skipped: CUDA compile check (nvcc not found)"; exit 0; fi; \
	 echo "cuda-check: compiling and linking the CUDA build for $(CHECK_ARCH)"; \
	 $(MAKE) --no-print-directory $(B)/cuda-$(CHECK_ARCH)/ds4 $(B)/cuda-$(CHECK_ARCH)/test_backend_ops \
	   $(B)/cuda-$(CHECK_ARCH)/ds4_bench $(B)/cuda-$(CHECK_ARCH)/matvec_table $(B)/cuda-$(CHECK_ARCH)/bandwidth $(B)/cuda-$(CHECK_ARCH)/launch_floor $(B)/cuda-$(CHECK_ARCH)/spin_wait $(B)/cuda-$(CHECK_ARCH)/mma_peak $(B)/cuda-$(CHECK_ARCH)/l2_read \
	   $(B)/cuda-$(CHECK_ARCH)/spot_check $(B)/cuda-$(CHECK_ARCH)/test_rollback $(B)/cuda-$(CHECK_ARCH)/mtp_dump $(B)/cuda-$(CHECK_ARCH)/test_cuda_quant_host \
	   CUDA_ARCH=$(CHECK_ARCH) && \
	 $(B)/cuda-$(CHECK_ARCH)/test_cuda_quant_host

# ---- tests ----
include tests/oracle/Makefile.inc

$(B)/tests/test_gguf: tests/test_gguf.c $(CORE_SRC) $(SYNTH_SRC) $(HOOKS_SRC) $(QUANT_SRC) $(TOK_SRC) $(MSG_SRC)
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/test_gguf.c ds4_hooks.c ds4_quant.c ds4_tok.c ds4_msg.c -o $@ $(LDLIBS)

$(B)/tests/test_kernels: tests/test_kernels.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/test_kernels.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o -o $@ $(LDLIBS)

$(B)/tests/test_hooks_plan: tests/test_hooks_plan.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/test_hooks_plan.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o -o $@ $(LDLIBS)

$(B)/tests/mtp_dump: tests/mtp_dump.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/mtp_dump.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o -o $@ $(LDLIBS)

$(B)/tests/test_rollback: tests/test_rollback.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. $^ -o $@ $(LDLIBS)

$(B)/tests/test_hooks_hold: tests/test_hooks_hold.c $(B)/cpu/ds4.o $(B)/cpu/ds4_synth.o $(B)/cpu/ds4_hooks.o $(B)/cpu/ds4_quant.o $(B)/cpu/ds4_tok.o $(B)/cpu/ds4_msg.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. $^ -o $@ $(LDLIBS)

test-c: $(B)/tests/test_gguf $(B)/tests/test_kernels $(B)/tests/test_hooks_plan $(B)/tests/test_hooks_hold $(B)/tests/test_rollback
	$(B)/tests/test_gguf
	$(B)/tests/test_kernels
	$(B)/tests/test_hooks_plan
	$(B)/tests/test_hooks_hold
	$(B)/tests/test_rollback

# What the tests need beyond gcc and make: python3 with pytest and numpy, npm, git.
# Installs the missing Debian packages as root; otherwise prints the command and stops.
test-deps:
	@bash scripts/test-deps.sh
.PHONY: test-deps

# pytest on TEST_WORKERS processes (tests/run_pytest.sh): the CI machine's 2 cores
TEST_WORKERS ?= 2
test-py: test-deps cpu $(B)/tests/mtp_dump
	TEST_WORKERS=$(TEST_WORKERS) bash tests/run_pytest.sh

test-gpu: cuda-check
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(B)/cuda-$(CHECK_ARCH)/test_backend_ops && TEST_DS4_CUDA_BIN=$(B)/cuda-$(CHECK_ARCH)/ds4 bash tests/run_pytest.sh -m gpu; \
	else echo "skipped: no GPU (GPU tests: backend ops, CUDA vs CPU logits)"; fi

# Every GPU operation of the CUDA sources on ds4_current_stream() (ds4_stream.h; its own test
# plants violations: tests/test_stream_check.py).
stream-check:
	python3 scripts/check_streams.py

# The patch series (patches/README.md): the baseline rebuilt from HEAD, each stage built and
# tested, HEAD reached byte for byte.
series-check:
	bash scripts/series.sh check

# test-deps first, also under make -j: a bare machine installs (or stops) before any build.
# Each phase announced with the seconds spent so far (the 2-core CI machine has a time limit).
# TEST_BESIDE (cuda-check: nvcc's units, TEST_JOBS at a time) runs beside TEST_PHASES_A (the
# CPU engine, the C tests, the fuzz phases: one process at a time most of their time), its
# output kept in $(B)/test-beside.log and shown when both are done; then TEST_PHASES_B.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
TEST_BESIDE := cuda-check
TEST_PHASES_A := stream-check cpu test-c fuzz-replay fuzz-ci
TEST_PHASES_B := test-py test-gpu series-check
test: test-deps
	@t0=$$(date +%s); mkdir -p $(B); rm -f $(B)/test-beside.rc; \
	 echo "== make test: $(TEST_BESIDE), beside the next $(words $(TEST_PHASES_A)) phases (its output after them)"; \
	 ( $(MAKE) --no-print-directory -j$(TEST_JOBS) $(TEST_BESIDE) > $(B)/test-beside.log 2>&1; \
	   echo $$? > $(B)/test-beside.rc ) & bp=$$!; \
	 for p in $(TEST_PHASES_A); do \
	  echo "== make test: $$p ($$(( $$(date +%s) - t0 )) s so far)"; \
	  $(MAKE) --no-print-directory $$p || { echo "make test: $$p failed"; wait $$bp; exit 1; }; \
	 done; \
	 wait $$bp; echo "== make test: $(TEST_BESIDE), done at $$(( $$(date +%s) - t0 )) s:"; cat $(B)/test-beside.log; \
	 [ "$$(cat $(B)/test-beside.rc 2>/dev/null)" = 0 ] || { echo "make test: $(TEST_BESIDE) failed"; exit 1; }; \
	 for p in $(TEST_PHASES_B); do \
	  echo "== make test: $$p ($$(( $$(date +%s) - t0 )) s so far)"; \
	  $(MAKE) --no-print-directory $$p || { echo "make test: $$p failed"; exit 1; }; \
	 done; echo "make test: all done in $$(( $$(date +%s) - t0 )) s"

# The inner loop: the CPU engine, the C tests and the pytest files that need no oracle.
test-quick: test-deps cpu test-c $(B)/tests/mtp_dump
	TEST_QUICK=1 bash tests/run_pytest.sh
.PHONY: test-quick

# ---- fuzzing (tests/fuzz/README.md): libFuzzer targets for the GGUF reader, the tokenizer,
# the DS4_* environment and the command-line parsers, and a DS4LOGIT mutation loop.
# `make test` replays the corpus, then fuzzes every target for FUZZ_CI_SECONDS (5 x 10 s,
# FUZZ_CI_JOBS targets at a time; skipped, with a line saying so, where clang cannot link
# libFuzzer). ----
FUZZ_SECONDS ?= 60
FUZZ_CI_SECONDS ?= 10
fuzz: cpu
	bash scripts/fuzz.sh run $(FUZZ_SECONDS)
FUZZ_CI_JOBS ?= 2
fuzz-build:
	bash scripts/fuzz.sh build
# both after fuzz-build, also under make -j: they run the same binaries
fuzz-replay: cpu fuzz-build
	bash scripts/fuzz.sh replay
fuzz-ci: cpu fuzz-build
	FUZZ_JOBS=$(FUZZ_CI_JOBS) bash scripts/fuzz.sh ci $(FUZZ_CI_SECONDS)
.PHONY: fuzz fuzz-build fuzz-replay fuzz-ci

# ---- sanitizers: the malformed-input tests under ASan + UBSan ----
SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
sanitize: cpu
	@mkdir -p $(B)/san
	$(CC) -std=c11 -O1 -g $(SAN) -Wall -Wextra -Wno-unused-parameter -pthread -I. tests/test_gguf.c ds4_hooks.c ds4_quant.c ds4_tok.c ds4_msg.c -o $(B)/san/test_gguf $(LDLIBS)
	$(CC) -std=c11 -O1 -g $(SAN) -Wall -Wextra -Wno-unused-parameter -pthread ds4.c ds4_synth.c ds4_hooks.c ds4_quant.c ds4_tok.c ds4_msg.c ds4_cli.c ds4_collect.c -o $(B)/san/ds4 $(LDLIBS)
	ASAN_OPTIONS=detect_leaks=0 $(B)/san/test_gguf
	@mkdir -p $(B)/san/models && cp -f models/ds4-tiny.gguf $(B)/san/models/ 2>/dev/null || $(B)/san/ds4 synth --config tiny --seed 1 -o $(B)/san/models/ds4-tiny.gguf
	ASAN_OPTIONS=detect_leaks=0 TEST_DS4_BIN=$(CURDIR)/$(B)/san/ds4 /usr/bin/python3 -m pytest -q tests/test_cli.py

clean:
	rm -rf $(B) ds4 models
