# make demo: create .venv, install qatune, train -> eval -> generate on the offline example.
# make test: create .venv, install qatune with test extras, run the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch (on a GPU machine: make TORCH=torch).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/qatune train --config configs/tiny-gpt2.yaml --overwrite
	$(BIN)/qatune eval runs/tiny-gpt2 --data examples/data/faq.csv
	$(BIN)/qatune generate runs/tiny-gpt2 "what character did john noble play in lord of the rings?"

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
