#!/usr/bin/env bash
# The test suite on the oldest versions requirements.txt and requirements-dev.txt allow (each
# `>=` read as `==`), in a fresh virtual environment of the oldest Python the README names:
#   bash dev/oldest_versions.sh [python3.10] [folder for the environment, made anew]
# Run it after raising or lowering a requirement; dev/LOG.md has its last result.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3.10}
VENV=${2:-$(mktemp -d)/venv}
if [ -e "$VENV" ]; then echo "$VENV exists: name a new folder" >&2; exit 2; fi
"$PY" -m venv "$VENV"
# shellcheck disable=SC2046  # one argument a requirement
"$VENV/bin/pip" install --quiet $(sed -n 's/>=/==/p' requirements.txt requirements-dev.txt)
"$VENV/bin/python" --version
"$VENV/bin/pip" list --format freeze | grep -i -E "^($(sed -n 's/>=.*//p' requirements.txt \
    requirements-dev.txt | paste -sd '|'))=="
"$VENV/bin/python" -m pytest -q -n auto -p no:cacheprovider
