# ds4 -- build, default model, tests.
#
#   make                         CPU engine ./ds4 + the embedded default model models/ds4-tiny.gguf
#   make cpu                     the same
#   make test                    every test
#   make sanitize                malformed-input tests under -fsanitize=address,undefined
#   make clean

CC      ?= cc
CFLAGS  ?= -O2 -g
CFLAGS  += -std=c11 -Wall -Wextra -Wno-unused-parameter -pthread
LDLIBS  += -lm -lpthread
PYTHON  ?= python3
B       := build

CORE_SRC := ds4.c ds4.h ds4_gpu.h

.PHONY: all cpu test test-c test-py sanitize clean models

all: cpu

cpu: ds4-cpu-build models/ds4-tiny.gguf

ds4-cpu-build: $(B)/cpu/ds4
	cp $(B)/cpu/ds4 ds4
	@echo "built ./ds4 (CPU backend)"

$(B)/cpu/ds4.o: $(CORE_SRC)
	@mkdir -p $(B)/cpu
	$(CC) $(CFLAGS) -c ds4.c -o $@

$(B)/cpu/ds4_cli.o: ds4_cli.c ds4.h ds4_gpu.h
	@mkdir -p $(B)/cpu
	$(CC) $(CFLAGS) -c ds4_cli.c -o $@

$(B)/cpu/ds4: $(B)/cpu/ds4.o $(B)/cpu/ds4_cli.o
	$(CC) $(CFLAGS) $^ -o $@ $(LDLIBS)

# The embedded default model: written by the build, never downloaded.
models/ds4-tiny.gguf: $(B)/cpu/ds4
	@mkdir -p models
	$(B)/cpu/ds4 synth --config tiny --seed 1 -o $@

models: models/ds4-tiny.gguf

# ---- tests ----
include tests/oracle/Makefile.inc

$(B)/tests/test_gguf: tests/test_gguf.c $(CORE_SRC)
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/test_gguf.c -o $@ $(LDLIBS)

$(B)/tests/test_kernels: tests/test_kernels.c $(B)/cpu/ds4.o
	@mkdir -p $(B)/tests
	$(CC) $(CFLAGS) -I. tests/test_kernels.c $(B)/cpu/ds4.o -o $@ $(LDLIBS)

test-c: $(B)/tests/test_gguf $(B)/tests/test_kernels
	$(B)/tests/test_gguf
	$(B)/tests/test_kernels

test-py: cpu
	bash tests/run_pytest.sh

test: cpu test-c test-py
	@echo "make test: all done"

# ---- sanitizers: the malformed-input tests under ASan + UBSan ----
SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
sanitize: cpu
	@mkdir -p $(B)/san
	$(CC) -std=c11 -O1 -g $(SAN) -Wall -Wextra -Wno-unused-parameter -pthread -I. tests/test_gguf.c -o $(B)/san/test_gguf $(LDLIBS)
	$(CC) -std=c11 -O1 -g $(SAN) -Wall -Wextra -Wno-unused-parameter -pthread ds4.c ds4_cli.c -o $(B)/san/ds4 $(LDLIBS)
	ASAN_OPTIONS=detect_leaks=0 $(B)/san/test_gguf
	@mkdir -p $(B)/san/models && cp -f models/ds4-tiny.gguf $(B)/san/models/ 2>/dev/null || $(B)/san/ds4 synth --config tiny --seed 1 -o $(B)/san/models/ds4-tiny.gguf
	ASAN_OPTIONS=detect_leaks=0 TEST_DS4_BIN=$(CURDIR)/$(B)/san/ds4 /usr/bin/python3 -m pytest -q tests/test_cli.py

clean:
	rm -rf $(B) ds4 models
