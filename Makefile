# Two commands on a fresh machine: `make demo` runs the demo, `make test` runs every test
# (after lint and the strict docs build).
# Each creates .venv and installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-repeat lint docs bench-drift install settings-table

# Concurrency-sensitive tests (store worker threads against close, PostgreSQL pools racing and
# its database cut, kill -9 recovery, MCP stream
# resumption, correlation and cross-traffic joining across calls, reload under traffic, a
# recorded answer across kill -9, run-key lock shards, counted refusals, listener slots, approvals
# bound to their call, a tool client's own run header, stream faults, A2A sends joined to a model's
# calls, answers the MCP and model SDKs read with calls in flight), run REPEAT more times after the
# suite: a race that passes by luck once fails here instead of on someone's clean clone. Four
# rounds (~90 s each on the 2-core CI machine) keep the whole CI run under 30 minutes. A costly
# test of these files that races nothing is marked `once` and left out of the rounds.
REPEAT ?= 4
REPEATED := tests/contracts/test_store.py tests/contracts/test_sqlite_store_counts.py \
	tests/contracts/test_pg_store.py tests/proxy/test_pg_store_faults.py \
	tests/proxy/test_mcp_resumption.py tests/proxy/test_recovery.py \
	tests/proxy/test_correlation.py tests/proxy/test_reload.py tests/metrics/test_runs_gauge.py \
	tests/proxy/test_replay_recorded_crash.py tests/proxy/test_joining.py \
	tests/proxy/test_holds.py tests/contracts/test_sqlite_store_shared.py \
	tests/contracts/test_run_book.py tests/contracts/test_pg_run_locks.py \
	tests/metrics/test_log_writer.py tests/proxy/test_run_key_locks.py \
	tests/proxy/test_repeated_refusals.py tests/proxy/test_listener_slots.py \
	tests/proxy/test_hold_binding.py tests/e2e/test_hybrid_tool_run_header.py \
	tests/proxy/test_stream_faults.py tests/proxy/test_joining_a2a.py \
	tests/e2e/test_hybrid_a2a.py tests/proxy/test_learn_mode_joining.py \
	tests/proxy/test_mcp_in_band_approval.py tests/proxy/test_mcp_tool_lists.py \
	tests/proxy/test_a2a_traffic.py tests/e2e/test_a2a.py tests/e2e/test_a2a_tasks.py \
	tests/proxy/test_a2a_sdk_fields.py tests/proxy/test_a2a_read_as_clients_read.py \
	tests/proxy/test_mcp_sdk_reads.py tests/proxy/test_model_sdk_reads.py \
	tests/proxy/test_learn_mode_writes.py tests/contracts/test_run_book_runs.py
# ... and the multi-process ones (worker processes, replicas on one store: ~75 s a pass, each
# test starting two or three stepguard processes) REPEAT_PROCESSES more times, so the repeat
# pass stays within a few minutes of CI
REPEAT_PROCESSES ?= 2
REPEATED_PROCESSES := tests/proxy/test_workers.py tests/proxy/test_replicas.py \
	tests/proxy/test_admin_listener_flood.py

$(BIN)/stepguard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,docs]'
	touch $@

install: $(BIN)/stepguard

demo: install
	$(BIN)/stepguard demo

# the docs site (mkdocs.yml: strict, every nav entry, link and anchor must resolve) into build/site
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --quiet

# the settings table of docs/running.md, from the declarations in proxy/core/config.py
settings-table: install
	$(BIN)/python -m stepguard.proxy.core.config docs/running.md

bench-drift: install
	$(BIN)/stepguard bench drift

lint: install
	$(BIN)/ruff check .
	@# mypy and pyright resolve stepguard.* through the committed stepguard/ symlinks (ARCHITECTURE.md)
	$(BIN)/mypy
	$(BIN)/pyright

test: install lint docs
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory test-repeat

test-repeat: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m 'not once' --count $(REPEAT) $(REPEATED)
	$(BIN)/python -m pytest -q -p no:cacheprovider --count $(REPEAT_PROCESSES) $(REPEATED_PROCESSES)
