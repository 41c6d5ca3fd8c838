# Sourced by setup.sh: `pip ARGS...` runs the project venv's pip quietly and returns pip's own exit status
# (`PIP_VENV=.venv-vllm pip ARGS...`: another venv's pip). The filter drops pip's noisy 'WARNING: Location' lines;
# `grep -v` exits 1 whenever it prints nothing (pip -q is usually silent), so its status is discarded and pipefail
# hands back pip's.
set -o pipefail

pip() {
  "${PIP_VENV:-.venv}/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
