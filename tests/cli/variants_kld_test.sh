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
# Then the same for the committed GGUF battery (tests/fixtures/gguf_battery: a tiny random llama in
# every file type llama-quantize writes, TQ1_0, TQ2_0, Q1_0 and Q2_0 among them, and MXFP4 and NVFP4 mixes):
# quantized KLD < 0.003 and the same top token >= 95% (measured 3.0e-4 .. 6.2e-4 and 97-99%; TQ1_0
# 5.4e-4, Q1_0 2.1e-4, Q2_0 5.8e-4, MXFP4 2.9e-4, NVFP4 3.1e-4; another quantization of
# the same weights, TQ1_0 or Q2_K against Q4_K_M's log-probs, 1.26-3.51 and 16-37%), F16 and BF16 as
# above (1e-6, 2.4e-5). These run without models/variants: only llama-perplexity is needed.
# Without llama-perplexity it is skipped (exit 77), and without models/variants skipped after the
# battery (unless a battery file failed), unless LOOM_REQUIRE_GGUF_VARIANTS=1 (scripts/test), where
# that is a failure.
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
[[ -x "$perplexity" ]] || missing "$perplexity is missing: run scripts/make_gguf_variants (scripts/test does)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src/README.md" "$src/docs/architecture.md" >"$tmp/text.txt"

# "Mean    KLD:   0.006617 ±   0.000196" -> 0.006617
field() { grep -o "$1: *[0-9.e-]*" "$2" | awk '{print $NF}'; }
fail=0
count=0
# compare FILE TYPE TEXT MAX_KLD MIN_TOP: llama-perplexity's log-probs against loom's.
compare() {
  local file=$1 type=$2 text=$3 max_kld=$4 min_top=$5
  if ! "$perplexity" -m "$file" -f "$text" -c 128 -b 128 --chunks 16 -t 2 \
      --kl-divergence-base "$tmp/base.kld" >"$tmp/llama.out" 2>&1; then
    tail -n 5 "$tmp/llama.out"
    echo "FAIL $type: llama-perplexity failed"
    fail=1
    return
  fi
  if ! "$loom" perplexity -m "$file" -t 2 --kl-divergence-base "$tmp/base.kld" --kl-divergence \
      >"$tmp/loom.out" 2>&1; then
    tail -n 5 "$tmp/loom.out"
    echo "FAIL $type: loom perplexity --kl-divergence failed"
    fail=1
    return
  fi
  rm -f "$tmp/base.kld"
  local kld top
  kld=$(field "Mean    KLD" "$tmp/loom.out")
  top=$(field "Same top p" "$tmp/loom.out")
  printf '| %s | %s | %s | %s%% |\n' "$type" "$kld" "$(field "Maximum KLD" "$tmp/loom.out")" "$top"
  if [[ -z "$kld" || -z "$top" ]] || ! awk -v k="$kld" -v t="$top" -v mk="$max_kld" -v mt="$min_top" \
      'BEGIN { exit !(k < mk && t >= mt) }'; then
    echo "FAIL $type: mean KLD '$kld' (must be < $max_kld), same top token '$top'% (must be >= $min_top%)"
    fail=1
  fi
  count=$((count + 1))
}

printf '| battery file | mean KLD | max KLD | same top token |\n|---|---|---|---|\n'
for file in "$src"/tests/fixtures/gguf_battery/tiny.*.gguf; do
  name=$(basename "$file" .gguf)
  type=${name##*.}
  case "$type" in
    F16) compare "$file" "tiny.$type" "$tmp/text.txt" 1e-4 99 ;;
    BF16) compare "$file" "tiny.$type" "$tmp/text.txt" 1e-3 97 ;;
    *) compare "$file" "tiny.$type" "$tmp/text.txt" 0.003 95 ;;
  esac
done
if [[ ! -f "$fixture" ]]; then
  echo "$count battery files compared"
  [[ $fail -eq 0 ]] || exit 1
  missing "$fixture is missing: run scripts/make_gguf_variants (scripts/test does)"
fi

printf '| file | mean KLD | max KLD | same top token |\n|---|---|---|---|\n'
for path in $(grep -o '"path": "[^"]*"' "$fixture" | sed 's/"path": "\(.*\)"/\1/'); do
  file=$src/$path
  name=$(basename "$file" .gguf)
  type=${name##*.}
  case "$type" in
    F16) compare "$file" "$type" "$tmp/text.txt" 1e-4 99 ;;
    BF16) compare "$file" "$type" "$tmp/text.txt" 1e-3 97 ;;
    IQ1_S | IQ1_M) compare "$file" "$type" "$tmp/text.txt" 0.025 88 ;;
    *) compare "$file" "$type" "$tmp/text.txt" 0.015 88 ;;
  esac
done
[[ $count -gt 0 ]] || { echo "FAIL: no files in $fixture"; exit 1; }
echo "$count files compared (battery and variants)"
exit $fail
