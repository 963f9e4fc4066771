# metald: the front door. Every target installs what it needs first (scripts/bootstrap).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
MACHINES ?= 3
LAB ?= lab

.PHONY: all setup demo test test-long test-fast lint format bench bench-storm-regress bootassets ipxe nodeimage debianimage lab-up lab-down clean

all: test

setup:
	@./scripts/bootstrap

demo: setup
	$(PY) -m vmlab.demo

test: setup
	$(VENV)/bin/pytest -q -rs --durations=15 $(PYTEST_ARGS)

# The long lab variants too (METALD_LAB_LONG=1): virtual-media provisioning and wipe (BIOS and
# UEFI), Day-2 health in QEMU (drain, replace, repair) and a flapping rack of ipmi_sim BMCs,
# kill -9 failovers (remediation, mid-flash firmware, Patroni's primary), the token capture with
# a man in the middle, arm64 images and an arm64 machine to ready, attestation with swtpm and
# OVMF, Secure Boot, RAID/LVM deploy and wipe, elastic Slurm with real slurmds, two tenants'
# Slurm clusters in QEMU, a disk node's reboot, the fleet and commissioning benches, the QEMU
# commissioning lab and the three-instance QEMU failover. The first run
# builds metald's iPXE (needs its source: BOOTASSETS_IPXE_SOURCE or .cache/vendor/).
test-long: setup
	METALD_LAB_LONG=1 $(VENV)/bin/pytest -q -rs --durations=15 $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest -q -m "not lab" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .

bench: setup
	@for b in bench/dhcp_bench.py bench/tftp_bench.py bench/http_bench.py bench/bmc_fanout.py bench/firmware_rollout.py bench/storm.py bench/fleet.py bench/ui_fleet.py bench/boot_path.py; do \
		echo "== $$b"; $(PY) $$b || exit 1; done

# The enrollment storm on STORM_BASE (a git rev, exported) and on this tree, interleaved
# rounds; fails when this tree's metald CPU per machine is over the base's (1.00x, bench/STORM.md).
STORM_BASE ?= 9bfe316
STORM_ROUNDS ?= 3
bench-storm-regress: setup
	$(PY) bench/storm_compare.py --base $(STORM_BASE) --rounds $(STORM_ROUNDS)

bootassets: setup
	$(PY) -m bootassets build

# metald's own iPXE from source (docs/boot.md): IPXE_SOURCE (tarball or clone) and IPXE_CA
# (metald's CA certificate) are passed on; ASSETS_DIR, when set, gets the binaries in ipxe/.
ipxe: setup
	$(PY) -m bootassets ipxe $(if $(IPXE_SOURCE),--source $(IPXE_SOURCE)) $(if $(IPXE_CA),--ca $(IPXE_CA)) $(if $(ASSETS_DIR),--install $(ASSETS_DIR))

nodeimage: setup
	$(PY) -m bootassets node

debianimage: setup
	$(PY) -m bootassets debian

lab-up: setup
	$(PY) -m vmlab up --machines $(MACHINES) --name $(LAB)

lab-down: setup
	$(PY) -m vmlab down --name $(LAB)

clean:
	rm -rf .pytest_cache .ruff_cache var
