# One entry point for a fresh machine. Every target sets up what it needs itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= models/shakespeare
BUNDLE ?= models/shakespeare-onnx
PROMPT ?= ROMEO:

.PHONY: help install test test-serving test-avx2-view avx2-view-tests lint serve generate protos train bundle train-g2p bundle-g2p serve-g2p bench-onnx bench-quantization real-shapes bench-peers bench-llama-cpp bench soak lmeval-venv clean

help:
	@echo "make serve      serve the shipped default model: gRPC on localhost:50051, HTTP (OpenAI API) on :8000, metrics on :9464"
	@echo "make generate   sample text from the shipped default model in-process"
	@echo "make test       run the whole test suite (sets up .venv and .venv-lmeval first), then the serving lane"
	@echo "make test-serving  the engine, runtime, server and CLI tests in .venv-serving: the serving install"
	@echo "make test-avx2-view  the tests that depend on onnxruntime's kernels again, on an AVX2-only view of this CPU"
	@echo "                only (no torch), as the container has it, on the shipped bundle"
	@echo "make train      retrain the default model: GPT and Llama-style layouts at two schedules (~90 min on 2 cores)"
	@echo "make bundle     export the default model to its ONNX bundle and verify it"
	@echo "make train-g2p  retrain the grapheme-to-phoneme encoder-decoder on CMUdict (about 2 hours on 2 cores)"
	@echo "make bundle-g2p export it to its ONNX bundle (fp32 and INT8 pairs), verify it, score it (greedy, beams)"
	@echo "make serve-g2p  serve it: the prompt is a word, the completion its phonemes"
	@echo "make bench-onnx export every graph variant and measure nodes, latency, held-out bits/char"
	@echo "make bench-quantization  every reduced-precision candidate against fp32 on this CPU (docs/onnx.md)"
	@echo "make real-shapes  random-weight models at real shapes (Qwen2.5 0.5B and 1.5B, Llama 3.2 1B, a 131k-position Llama), HF"
	@echo "                checkpoint, model directory and bundle, built once under ~/.cache/attnserve/real-shapes"
	@echo "                (SHAPES=\"qwen2.5-0.5b llama-131k\" to choose; bench/real_shapes.py)"
	@echo "make bench      the serving benchmarks: gRPC load, the comparison with the peers, the G2P model against"
	@echo "                CTranslate2 and transformers (docs/BENCHMARKS.md)"
	@echo "make soak       10 minutes of mixed load: server memory, throughput and errors over time"
	@echo "make bench-peers  the peers' virtualenvs for the comparison: .venv-peers (transformers + optimum), .venv-ct2"
	@echo "                (CTranslate2), .venv-openvino (OpenVINO through optimum-intel)"
	@echo "make bench-llama-cpp  llama.cpp's programs, built for this CPU (cached), and its converter's .venv-llama-cpp"
	@echo "make lmeval-venv  .venv-lmeval: lm-evaluation-harness for the log-likelihood test against a live server"
	@echo "make lint       ruff"

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

install: $(BIN)/.installed

test: install .venv-lmeval/bin/.installed  # lm-evaluation-harness, for tests/fronts/test_lm_eval.py
	$(BIN)/python -m pytest --durations=20  # the slowest twenty, so a run that grows says where
	$(MAKE) --no-print-directory test-serving
	$(MAKE) --no-print-directory test-avx2-view

# The AVX2-only lane: onnxruntime picks its kernels from CPUID, and AVX2 without VNNI computes otherwise (u8s8
# pair sums saturate; 4-bit blocks round otherwise), so the tests whose outcome depends on the kernels (graph
# choice, self-check, batch invariance, the engine on each graph) run again with CPUID masked to AVX2
# (tests/avx2_view/mask_cpuid.c, LD_PRELOAD: native speed, on CPUs that can fault on CPUID), and the
# self-checks on AVX2 run there rather than under qemu. An AVX2-only CPU needs no second run; a CPU the lane
# cannot mask leaves the AVX2 kernels to the qemu tests. Which it is: tests/avx2_view where_avx2_kernels_run.
AVX2_VIEW       := .cache/avx2-view/mask_cpuid.so
AVX2_VIEW_TESTS ?= tests/runtime tests/engine tests/export/test_int4.py tests/export/test_row_quantization.py \
                   tests/export/test_kv_precision.py tests/export/test_default_bundle.py \
                   tests/export/test_seq2seq_export.py tests/export/test_avx2_emulated.py \
                   tests/fronts/test_batch_invariance.py

$(AVX2_VIEW): tests/avx2_view/mask_cpuid.c
	mkdir -p $(dir $@)
	cc -O2 -shared -fPIC -o $@ $<

test-avx2-view: install
	@case "$$($(PYTHON) -c 'from tests.avx2_view import where_avx2_kernels_run as w; print(w())')" in \
	native) echo "test-avx2-view: this CPU has AVX2 without AVX-512, AVX-VNNI or AMX:" \
		"the main run was on its AVX2 kernels";; \
	qemu) echo "test-avx2-view: this CPU cannot be masked to AVX2 here (it cannot fault on CPUID, or there is" \
		"no C compiler): the AVX2 kernels are tested under qemu alone (tests/export/test_avx2_emulated.py)";; \
	*) $(MAKE) --no-print-directory avx2-view-tests;; \
	esac

avx2-view-tests: $(AVX2_VIEW)  # the lane itself, once test-avx2-view found the view can be made here
	LD_PRELOAD=$(abspath $(AVX2_VIEW)) $(BIN)/python -m pytest -p no:faulthandler --avx2-view $(AVX2_VIEW_TESTS)

# The serving lane: attnserve installed as the image installs it (pip install of the sources the Dockerfile
# copies, not editable, no extras: no torch, no onnx, no transformers), and the engine, runtime, server and
# CLI tests run against that installed copy on the shipped bundle. PYTHONSAFEPATH keeps the working
# directory off sys.path (in the test processes and in the servers and CLIs they start) and
# --import-mode=append puts the tree after site-packages, so `service` and `attnserve` are the installed
# ones and only `tests` comes from the tree. Tests that need torch to build a model are skipped, each
# with its reason in the report. Test tools, installed after the image's removals: pytest, cryptography
# for the TLS tests, the openai client for the HTTP front, and jsonschema for structured output.
SERVING         := .venv-serving
SERVING_BIN     := $(SERVING)/bin
SERVING_SOURCES := pyproject.toml README.md attnserve service model export bench
SERVING_TESTS   ?= tests/engine tests/runtime tests/fronts tests/client tests/test_cli.py

# What the Dockerfile uninstalls from the image once attnserve is in (but pip and setuptools, which install
# the sources again below): the server must run without them.
IMAGE_REMOVES   := huggingface_hub hf_xet fsspec pyyaml httpx2 httpcore2 tqdm filelock truststore

# the dependencies (the sources are installed again, without them, on every run)
$(SERVING_BIN)/.installed: pyproject.toml constraints.txt Dockerfile
	rm -rf $(SERVING)
	$(PYTHON) -m venv $(SERVING)
	mkdir -p $(SERVING)/src && cp -R $(SERVING_SOURCES) $(SERVING)/src/
	$(SERVING_BIN)/pip install --quiet -c constraints.txt $(SERVING)/src
	$(SERVING_BIN)/pip uninstall --quiet -y $(IMAGE_REMOVES)
	$(SERVING_BIN)/pip install --quiet -c constraints.txt pytest cryptography openai anthropic jsonschema
	touch $@

test-serving: $(SERVING_BIN)/.installed
	rm -rf $(SERVING)/src && mkdir -p $(SERVING)/src && cp -R $(SERVING_SOURCES) $(SERVING)/src/
	$(SERVING_BIN)/pip install --quiet --no-deps --force-reinstall $(SERVING)/src
	PYTHONSAFEPATH=1 $(SERVING_BIN)/python -c 'import importlib.util as u, sys; \
		found = [m for m in ("torch", "onnx", "transformers") if u.find_spec(m)]; \
		sys.exit("$(SERVING) has " + ", ".join(found) + ": the serving install must not pull them in" if found else 0)'
	PYTHONSAFEPATH=1 $(SERVING_BIN)/python -m pytest --import-mode=append --serving-bundle $(BUNDLE) $(SERVING_TESTS)

lint: install
	$(BIN)/ruff check .

serve: install
	$(BIN)/attnserve serve --bundle $(BUNDLE)

generate: install
	$(BIN)/attnserve generate "$(PROMPT)" --bundle $(BUNDLE) --max-new-tokens 120 --temperature 0.8 --top-p 0.95

protos: install
	$(BIN)/python protos/build.py

# The default model: the GPT and the Llama-style layouts, each at the default 1500 steps and at the step count
# that fills 30 minutes on 2 cores (docs/model.md), about 90 minutes in all; the candidate with the lowest
# held-out bits/char ships, with every candidate's figures and command on its card.
CANDIDATES := runs/shakespeare-gpt-1500 runs/shakespeare-llama-1500 runs/shakespeare-gpt runs/shakespeare-llama
train: install
	$(BIN)/attnserve train --arch gpt --max-steps 1500 --out runs/shakespeare-gpt-1500
	$(BIN)/attnserve train --arch llama --max-steps 1500 --out runs/shakespeare-llama-1500
	$(BIN)/attnserve train --arch gpt --max-steps 3300 --out runs/shakespeare-gpt
	$(BIN)/attnserve train --arch llama --max-steps 3900 --out runs/shakespeare-llama
	$(BIN)/python -m model.training.pick_default $(CANDIDATES) --out $(MODEL)

bundle: install
	rm -rf $(BUNDLE)
	$(BIN)/attnserve export $(MODEL) -o $(BUNDLE) --name shakespeare --int8 --no-fp32 --verify

# The grapheme-to-phoneme encoder-decoder (model/training/train_g2p.py): about 2 hours on 2 cores
G2P        := models/g2p-cmudict
G2P_BUNDLE := models/g2p-cmudict-onnx
train-g2p: install
	$(BIN)/attnserve train-g2p --out $(G2P)

bundle-g2p: install
	rm -rf $(G2P_BUNDLE)
	$(BIN)/attnserve export $(G2P) -o $(G2P_BUNDLE) --name g2p-cmudict --int8 --verify
	$(BIN)/attnserve score-g2p --model $(G2P) --bundle $(G2P_BUNDLE)

serve-g2p: install
	$(BIN)/attnserve serve --bundle $(G2P_BUNDLE)

bench-onnx: install
	$(BIN)/attnserve export $(MODEL) -o runs/bundle-all --optimize --int8 --fp16
	$(BIN)/attnserve bench onnx-variants --bundle runs/bundle-all --quality

bench-quantization: install
	$(BIN)/attnserve bench quantization
	$(BIN)/attnserve bench quantization --gpt2-shape

SHAPES ?=
real-shapes: install
	$(BIN)/python -m bench.real_shapes build $(SHAPES)

# The peers of `attnserve bench compare`, each in its own virtualenv, never in the runtime dependencies:
# .venv-peers (transformers + optimum with onnxruntime), .venv-ct2 (CTranslate2 and its converter) and
# .venv-openvino (optimum-intel with OpenVINO and nncf), torch pinned by constraints.txt in each. The
# torchvision that optimum-intel pulls in is built for another torch and breaks transformers' imports: removed.
# a virtualenv of its own with a requirements file installed, torch pinned by constraints.txt:
# $(call requirements_venv,DIR,REQUIREMENTS) in a recipe
define requirements_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet --upgrade pip
	$(1)/bin/pip install --quiet -c constraints.txt -r $(2)
endef

PEERS    := .venv-peers
CT2      := .venv-ct2
OPENVINO := .venv-openvino
$(PEERS)/bin/.installed: bench/requirements-peers.txt constraints.txt
	$(call requirements_venv,$(PEERS),bench/requirements-peers.txt)
	touch $@

$(CT2)/bin/.installed: bench/requirements-ct2.txt constraints.txt
	$(call requirements_venv,$(CT2),bench/requirements-ct2.txt)
	touch $@

$(OPENVINO)/bin/.installed: bench/requirements-openvino.txt constraints.txt
	$(call requirements_venv,$(OPENVINO),bench/requirements-openvino.txt)
	$(OPENVINO)/bin/pip uninstall --quiet -y torchvision
	touch $@

bench-peers: $(PEERS)/bin/.installed $(CT2)/bin/.installed $(OPENVINO)/bin/.installed

# llama.cpp as a peer (bench/peers/llama_cpp.py): llama-server, llama-batched-bench and llama-quantize (and
# llama-tokenize, for the GGUF import's tests), built for this CPU from the source the llama-cpp-python sdist vendors and cached under ~/.cache/attnserve/peers
# (about 10 minutes the first time); then .venv-llama-cpp, the virtualenv of that source's converter
# (convert_hf_to_gguf.py: its requirements, torch pinned by constraints.txt; bench/requirements-llama-cpp.txt)
LLAMA_CPP := .venv-llama-cpp
$(LLAMA_CPP)/bin/.installed: bench/requirements-llama-cpp.txt constraints.txt
	$(call requirements_venv,$(LLAMA_CPP),bench/requirements-llama-cpp.txt)
	touch $@

bench-llama-cpp: $(LLAMA_CPP)/bin/.installed
	bench/peers/build-llama-cpp.sh

# the comparison: every peer (bench-peers, bench-llama-cpp) and attnserve at the three sizes, one interleaved run
bench: install bench-peers bench-llama-cpp
	$(BIN)/attnserve bench serve --concurrency 1,8,32,64 --prompt-tokens 16 --new-tokens 128 --noop-check
	$(BIN)/attnserve bench serve --concurrency 1,8,32,64 --mixed
	$(BIN)/attnserve bench compare
	$(BIN)/attnserve bench g2p

# lm-evaluation-harness for tests/fronts/test_lm_eval.py (its `local-completions` model scoring log-likelihoods
# against a server the test starts); the test is skipped without this virtualenv. torch pinned by constraints.txt.
LMEVAL := .venv-lmeval
$(LMEVAL)/bin/.installed: tests/requirements-lmeval.txt constraints.txt
	$(call requirements_venv,$(LMEVAL),tests/requirements-lmeval.txt)
	touch $@

lmeval-venv: $(LMEVAL)/bin/.installed

soak: install
	$(BIN)/attnserve bench soak --minutes 10

clean:
	rm -rf $(VENV) $(PEERS) $(CT2) $(OPENVINO) $(SERVING) $(LMEVAL) .pytest_cache .ruff_cache .hypothesis .cache/avx2-view
