# Everything installs itself: a fresh machine of this kind needs only `make demo` or `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Debian packages the tests, the demo and the benchmarks use (installed only when missing).
# prometheus: the real server and promtool for the metrics, alert-rule and dashboard tests;
# wrk and nginx-light: the subscription endpoint's load benchmark and its static-file anchor;
# git and rsync: gitlab-ci-local runs the CI example in a repository (node and npm, which install it, come with this machine);
# pebble: Let's Encrypt's test ACME server (and its DNS stand-in) for the certificate lab test; openssl: the
# TLS 1.3 site REALITY presents in the tests; chromium and zbar-tools: the subscription page opened in a real
# headless browser, its screenshot's QR codes decoded by zbarimg (tests/test_page_browser.py); etcd-server: the
# coordination service of standby controllers — the tests start their own `etcd` on loopback ports (tests/test_leader.py),
# so the package's system service is disabled and stopped below (`apt`), never left running; postgresql: the users'
# database the tests start on their own loopback ports (tests/postgres.py), its system cluster stopped when this
# recipe installed it (one the machine already ran is left alone).
APT_PACKAGES := graphviz openssh-client curl iproute2 nftables systemd-container debootstrap prometheus wrk nginx-light pebble openssl git rsync \
	chromium zbar-tools etcd-server postgresql

.PHONY: setup apt test demo bench schema clean

setup: apt $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# The distribution was called `reconciler` before issue 15 (a name PyPI gives another project): replace it.
	@$(BIN)/pip uninstall -q -y reconciler >/dev/null 2>&1 || true
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	@# action-validator and gitlab-ci-local check and run the CI examples (tests/test_ci_examples.py).
	@if command -v npm >/dev/null; then npm install -q --no-audit --no-fund --prefix .tools \
	  @action-validator/cli@0.6.0 gitlab-ci-local@4.60.1 >/dev/null; fi
	@touch $@

apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make setup: need root to install:$$missing"; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  case " $$missing " in *" postgresql "*) if command -v systemctl >/dev/null; then \
	    systemctl disable --now postgresql >/dev/null 2>&1 || true; fi;; esac; \
	fi
	@# etcd-server's package enables (and, under systemd, starts) a system etcd: not ours to run. Idempotent; without
	@# systemd as init (containers, CI) the package starts nothing. Never by process name: a test's etcd may be running.
	@if command -v systemctl >/dev/null && systemctl is-enabled --quiet etcd 2>/dev/null; then \
	  systemctl disable --now etcd >/dev/null 2>&1 || true; fi

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: setup
	@$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

demo: setup
	$(BIN)/reconciler demo --scenario block --duration 180

bench: setup
	@set -e; found=0; for f in bench/*.py; do [ -e "$$f" ] && [ "$$f" != bench/harness.py ] || continue; found=1; echo "== $$f"; $(BIN)/python "$$f"; done; \
	[ $$found = 1 ] || echo "no benchmarks yet"

schema: setup
	$(BIN)/reconciler schema

clean:
	rm -rf $(VENV) .tools demo-output .pytest_cache .hypothesis
