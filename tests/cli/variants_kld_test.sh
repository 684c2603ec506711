#!/usr/bin/env bash
# loom's next-token distributions against llama.cpp's on the same file, for every file type of
# models/variants (scripts/make_gguf_variants): llama-perplexity writes its log-probs over 16 chunks
# of 128 tokens of loom's README and architecture notes (--kl-divergence-base, 1,024 scored tokens),
# `loom perplexity --kl-divergence` reads them, and the mean KL divergence and the share of tokens
# with the same top token must show the same function of the same weights:
#   quantized files: mean KLD < 0.015 and the same top token for >= 88% of the tokens. Measured
#     0.0038-0.0080 and 92.0-96.4% (against llama.cpp's AVX-512 and its AVX2 builds alike); a
#     neighbouring quantization of the same weights (IQ3_XXS or IQ3_M against IQ3_S's log-probs)
#     gives 0.074-0.165 and 74-84%, so this tells one file computed two ways from a nearby other
#     function, per file, which 16-token greedy text (test_gguf_variants.cpp) cannot.
#   IQ1_S, IQ1_M (1.56-1.75 bits per weight; a model this far from its weights amplifies every
#     rounding): KLD < 0.025, same top >= 88%. Measured 0.0099-0.0127 and 92.1-93.5% against the native
#     and the AVX2 llama.cpp; llama.cpp's AVX2 build against its native one gives 0.0106 on IQ1_S
#     itself; an IQ1 scale one step too large on the first 16 or 32 weights of every superblock
#     0.066-0.175, the other IQ1 file's log-probs 1.12.
#   F16: KLD < 1e-4 (measured 2e-6); BF16: KLD < 1e-3 (1.4e-4): f32 activations, float rounding only.
# Without models/variants or llama-perplexity it is skipped (exit 77), unless
# LOOM_REQUIRE_GGUF_VARIANTS=1 (scripts/test), where that is a failure.
# Usage: variants_kld_test.sh LOOM_BINARY SOURCE_DIR
set -u
loom=$1
src=$2
fixture=$src/models/variants/llamacpp_greedy.json
perplexity=$src/third_party/llama.cpp/bin/llama-perplexity
missing() {
  echo "$1"
  [[ "${LOOM_REQUIRE_GGUF_VARIANTS:-}" == "1" ]] && exit 1
  exit 77
}
[[ -f "$fixture" ]] || missing "$fixture is missing: run scripts/make_gguf_variants (scripts/test does)"
[[ -x "$perplexity" ]] || missing "$perplexity is missing: run scripts/make_gguf_variants (scripts/test does)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src/README.md" "$src/docs/architecture.md" >"$tmp/text.txt"

# "Mean    KLD:   0.006617 ±   0.000196" -> 0.006617
field() { grep -o "$1: *[0-9.e-]*" "$2" | awk '{print $NF}'; }
fail=0
count=0
printf '| file | mean KLD | max KLD | same top token |\n|---|---|---|---|\n'
for path in $(grep -o '"path": "[^"]*"' "$fixture" | sed 's/"path": "\(.*\)"/\1/'); do
  file=$src/$path
  name=$(basename "$file" .gguf)
  type=${name##*.}
  if ! "$perplexity" -m "$file" -f "$tmp/text.txt" -c 128 -b 128 --chunks 16 -t 2 \
      --kl-divergence-base "$tmp/base.kld" >"$tmp/llama.out" 2>&1; then
    tail -n 5 "$tmp/llama.out"
    echo "FAIL $type: llama-perplexity failed"
    fail=1
    continue
  fi
  if ! "$loom" perplexity -m "$file" -t 2 --kl-divergence-base "$tmp/base.kld" --kl-divergence \
      >"$tmp/loom.out" 2>&1; then
    tail -n 5 "$tmp/loom.out"
    echo "FAIL $type: loom perplexity --kl-divergence failed"
    fail=1
    continue
  fi
  rm -f "$tmp/base.kld"
  kld=$(field "Mean    KLD" "$tmp/loom.out")
  top=$(field "Same top p" "$tmp/loom.out")
  printf '| %s | %s | %s | %s%% |\n' "$type" "$kld" "$(field "Maximum KLD" "$tmp/loom.out")" "$top"
  case "$type" in
    F16) max_kld=1e-4 min_top=99 ;;
    BF16) max_kld=1e-3 min_top=97 ;;
    IQ1_S | IQ1_M) max_kld=0.025 min_top=88 ;;
    *) max_kld=0.015 min_top=88 ;;
  esac
  if [[ -z "$kld" || -z "$top" ]] || ! awk -v k="$kld" -v t="$top" -v mk="$max_kld" -v mt="$min_top" \
      'BEGIN { exit !(k < mk && t >= mt) }'; then
    echo "FAIL $type: mean KLD '$kld' (must be < $max_kld), same top token '$top'% (must be >= $min_top%)"
    fail=1
  fi
  count=$((count + 1))
done
[[ $count -gt 0 ]] || { echo "FAIL: no files in $fixture"; exit 1; }
echo "$count files compared"
exit $fail
