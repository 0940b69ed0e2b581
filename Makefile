# Two commands on a fresh machine: `make demo` runs the demo, `make test` runs every test.
# Each creates .venv and installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench-drift install

$(BIN)/stepguard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/stepguard

demo: install
	$(BIN)/stepguard demo

bench-drift: install
	$(BIN)/stepguard bench drift

lint: install
	$(BIN)/ruff check proxy contracts metrics examples tests
	@# mypy sees the source folders under their import names through a tree of symlinks
	rm -rf build/typecheck && mkdir -p build/typecheck/stepguard/examples
	ln -s ../../../proxy ../../../contracts ../../../metrics build/typecheck/stepguard/
	ln -s ../../../../examples/order-confirmation build/typecheck/stepguard/examples/order_confirmation
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p stepguard

test: install lint
	$(BIN)/python -m pytest
