#!/usr/bin/env bash
# Builds the project's environment in .venv from the pinned files in this repo. Idempotent: `make setup` only
# calls it when a pinned file changed. See ../README.md, "Setup".
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
export PIP_DISABLE_PIP_VERSION_CHECK=1 DVC_NO_ANALYTICS=1

if ! command -v "$PYTHON" >/dev/null; then
  echo "error: $PYTHON not found. lowmem needs Python 3.11 (fairseq 0.12 and the pinned torch wheels); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# Some machines' pip.conf names local indexes that do not exist; their warnings are noise.
pip() {
  set +e
  "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v "^WARNING: Location"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# torch first: fairseq-fixed compiles against it. --no-build-isolation keeps pip from putting a second, unpinned
# torch into fairseq's build environment.
pip install -q -r requirements.txt -c constraints.txt
pip install -q --no-build-isolation -r requirements-2.txt -c constraints.txt
pip install -q --no-deps --no-build-isolation -e .
# A kernel of this venv for papermill, nbval and JupyterLab, so notebooks never run in another Python.
"$VENV/bin/python" -m ipykernel install --sys-prefix --name lowmem --display-name "Python (lowmem)" >/dev/null
# papermill starts each kernel over TCP, and ipykernel warns at every start that TCP is unencrypted: noise on every
# notebook stage of `make repro`. The kernel reads this file from the venv's etc/ipython; errors still show.
mkdir -p "$VENV/etc/ipython"
echo 'c.IPKernelApp.log_level = "ERROR"  # written by scripts/setup.sh' > "$VENV/etc/ipython/ipython_kernel_config.py"

# Fashion-MNIST, the real image data that works offline (Debian's dataset-fashion-mnist). Optional: without it
# the cpu profile stops with instructions; tests and the smoke profile do not need it.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -qq --no-install-recommends dataset-fashion-mnist >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends dataset-fashion-mnist >/dev/null 2>&1; } ||
    echo "note: could not install Debian's dataset-fashion-mnist; the cpu profile will say how to get Fashion-MNIST" >&2
fi
# Debian's chromium and its driver, for the browser test of JupyterLab (tests/test_lab.py; skipped without them).
# Optional, like the dataset; Playwright's browser download needs the internet and does not work offline.
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1; } ||
    echo "note: could not install Debian's chromium and chromium-driver; the browser test of JupyterLab will be skipped" >&2
fi
# The cpu translation corpus: the German gettext catalogs of a fixed list of Debian packages (params.yaml,
# translation_data.gettext_packages). Installing the list makes the corpus the same on every machine of one
# Debian release; without them the translation stages stop and name the missing packages.
PKGS=$("$VENV/bin/python" -c 'import yaml; print(" ".join(yaml.safe_load(open("params.yaml"))["translation_data"]["gettext_packages"]))')
MISSING=$(for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
if [ -n "$MISSING" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $MISSING >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $MISSING >/dev/null 2>&1; } ||
    echo "note: could not install $MISSING; the cpu translation corpus needs them" >&2
fi
echo "environment ready: $VENV"
