#!/usr/bin/env bash
# ctest wrapper: runs test_openai_client.py with a Python that has the `openai` package:
# $LOOM_TEST_PYTHON, else <build>/test-venv (made by scripts/test), else python3. Exit 77 = skipped.
set -euo pipefail
LOOM="$1"
ROOT="$2"
PY="${LOOM_TEST_PYTHON:-}"
if [[ -z "$PY" ]]; then
  venv="$(dirname "$LOOM")/test-venv/bin/python"
  if [[ -x "$venv" ]]; then PY="$venv"; else PY=python3; fi
fi
exec "$PY" "$ROOT/tests/serve/test_openai_client.py" --loom "$LOOM" --model "$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
