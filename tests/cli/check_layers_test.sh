#!/usr/bin/env bash
# scripts/check_layers against fake trees: a clean one passes; each include that points up or
# sideways (or a folder that is no layer) fails, naming file:line and the include.
# Usage: check_layers_test.sh SOURCE_DIR
set -euo pipefail
SRC_DIR="${1:?usage: check_layers_test.sh SOURCE_DIR}"
CHECK="$SRC_DIR/scripts/check_layers"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fails=0

# A tree with the real layer list and one header per layer, each including the one below.
make_tree() {
  rm -rf "$TMP/t" && mkdir -p "$TMP/t/docs" && cp "$SRC_DIR/docs/architecture.md" "$TMP/t/docs/"
  local prev="" l
  for l in core kernels io tokenizer model train serve apps; do
    mkdir -p "$TMP/t/src/$l"
    if [[ -n "$prev" ]]; then echo "#include \"$prev/a.h\"" >"$TMP/t/src/$l/a.h"; else : >"$TMP/t/src/$l/a.h"; fi
    [[ $l == train || $l == serve ]] || prev=$l
  done
  echo '#include "train/a.h"' >>"$TMP/t/src/apps/a.h"
  mkdir -p "$TMP/t/src/kernels/ref" "$TMP/t/src/kernels/cpu"
  printf '#include <vector>\n#include "kernels/a.h"\n' >"$TMP/t/src/kernels/ref/r.h"
  printf '#include "kernels/ref/r.h"\n#include "local.inc"\n' >"$TMP/t/src/kernels/cpu/c.cpp"
}

# expect_fail NAME FILE LINE_TEXT EXPECTED_OUTPUT: appends LINE_TEXT to FILE in a clean tree.
expect_fail() {
  make_tree
  mkdir -p "$(dirname "$TMP/t/$2")" && echo "$3" >>"$TMP/t/$2"
  local out rc=0
  out="$("$CHECK" "$TMP/t" 2>&1)" || rc=$?
  if [[ $rc -eq 1 && "$out" == *"$4"* ]]; then echo "ok: $1"
  else echo "FAIL: $1: rc=$rc, expected '$4' in: $out"; fails=$((fails + 1)); fi
}

make_tree
if out="$("$CHECK" "$TMP/t" 2>&1)"; then echo "ok: clean tree passes"
else echo "FAIL: clean tree: $out"; fails=$((fails + 1)); fi

expect_fail "serve includes train (siblings)" src/serve/a.h '#include "train/a.h"' \
  'src/serve/a.h:2: #include "train/a.h": serve and train are siblings'
expect_fail "train includes serve (siblings)" src/train/b.cpp '#include "serve/a.h"' \
  'src/train/b.cpp:1: #include "serve/a.h": train and serve are siblings'
expect_fail "model includes train (upward)" src/model/m.cpp '  #  include "train/lora.h"' \
  'src/model/m.cpp:1: #  include "train/lora.h": train is above model'
expect_fail "core includes apps (upward)" src/core/x.h '#include "apps/a.h"' \
  'src/core/x.h:1: #include "apps/a.h": apps is above core'
expect_fail "io includes model (upward)" src/io/x.cpp \
  '#include "model/a.h"' 'src/io/x.cpp:1: #include "model/a.h": model is above io'
expect_fail "kernels/ref includes kernels/cpu" src/kernels/ref/r.h '#include "kernels/cpu/c.h"' \
  'src/kernels/ref/r.h:3: #include "kernels/cpu/c.h": kernels/ref/ may not include kernels/cpu/'
expect_fail "a folder that is no layer" src/scratch/d.h '#include "core/a.h"' \
  'src/scratch/: not a layer'

# Without the layer list it refuses to guess (exit 2).
make_tree
sed -i '/`layers: /d' "$TMP/t/docs/architecture.md"
rc=0; "$CHECK" "$TMP/t" >/dev/null 2>&1 || rc=$?
if [[ $rc -eq 2 ]]; then echo "ok: a missing layers line is exit 2"
else echo "FAIL: missing layers line: rc=$rc"; fails=$((fails + 1)); fi

[[ $fails -eq 0 ]] || { echo "$fails check_layers case(s) failed"; exit 1; }
echo "check_layers: all cases passed"
