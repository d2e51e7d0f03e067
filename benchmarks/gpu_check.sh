#!/usr/bin/env bash
# One prepared GPU check (see benchmarks/gpu_check.py for the steps), for a 1-GPU lease.
#   bash benchmarks/gpu_check.sh                 # on the GPU machine; results under $OUT (or out/gpu-check)
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # every step on the CPU (gloo), to test the script itself
# From a session with a device lease: run(command="bash benchmarks/gpu_check.sh", timeout_s=570);
# the steps share a 480 s budget (--budget S), and $OUT gets five files whatever happens.
# Python: .venv when it has torch and shardc (this checkout's Makefile install); otherwise the
# machine's own python3 (the GPU image's, which has torch but no registry access) gets shardc
# installed from this checkout without dependencies and without build isolation (offline).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export PYTHONUNBUFFERED=1

here_install() {  # is shardc importable by $1, from this checkout?
  "$1" -c "import pathlib, shardc, torch; assert pathlib.Path(shardc.__file__).resolve().parent == pathlib.Path('$root/compiler')" 2>/dev/null
}

if [ -x .venv/bin/python ] && here_install .venv/bin/python; then
  py=.venv/bin/python
else
  py=$(command -v python3)
  if ! here_install "$py"; then
    echo "[gpu_check] installing shardc into $py (no deps, offline)"
    if ! "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . ; then
      site=${TMPDIR:-/tmp}/shardc-site
      "$py" -m pip install -q --no-deps --no-build-isolation --no-index --target "$site" . || exit 2
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    here_install "$py" || "$py" -c "import shardc" || { echo "[gpu_check] shardc is not importable by $py"; exit 2; }
  fi
fi
echo "[gpu_check] python: $py ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
exec "$py" benchmarks/gpu_check.py "$@"
