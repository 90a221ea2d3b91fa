# One entry point for a fresh machine. Every target sets up what it needs itself.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= models/shakespeare
PROMPT ?= Rom.

.PHONY: help install test lint generate train clean

help:
	@echo "make generate   sample text from the shipped default model"
	@echo "make test       run the whole test suite (sets up .venv first)"
	@echo "make train      retrain the default model (about 30 minutes on 2 cores)"
	@echo "make lint       ruff"

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .

generate: install
	$(BIN)/attnserve generate-local "$(PROMPT)" --model $(MODEL)

train: install
	$(BIN)/attnserve train --out $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
