#!/usr/bin/env bash
# The live page of `loom train --metrics-port` in headless Chromium while a
# tiny-model run goes on: the DOM after the script ran holds the four charts
# with drawn curves and the run's state, and the screenshot is not blank: the
# curves' colours cover real lines (not only the legend swatches).
# Usage: train_live_page_test.sh LOOM_BINARY SOURCE_DIR [SCREENSHOT.png]
#   (exit 77: skipped, chromium missing, not under CI=true). SCREENSHOT.png keeps the picture.
set -u
. "$(dirname "$0")/train_monitor_common.sh"
require_tool chromium "headless browser, Debian package chromium"
keep=${3:-}

# A run long enough to be still going when the browser looks (about 10 s on the tiny model),
# evaluated every 200 steps; the test stops it once done looking.
port=$(free_port)
url="http://127.0.0.1:$port"
train_config 4000
sed -i 's/^eval_interval: .*/eval_interval: 200/' "$tmp/train.yaml"
start_training "$port"
wait_for 30 metric_at_least "$url/metrics" loom_train_step 450 ||
  die "the run did not reach step 450: $(tail -5 "$tmp/train.err")"
echo "[${SECONDS}s] step 450 reached; the browser loads the page"

browser() {  # browser ARGS...: headless Chromium on the page, with 40 s at most
  timeout 40 chromium --headless --no-sandbox --disable-gpu --disable-extensions --no-first-run \
    --user-data-dir="$tmp/chromium" --hide-scrollbars --virtual-time-budget=4000 "$@" "$url/" 2>>"$tmp/chromium.log"
}
browser --dump-dom >"$tmp/dom.html" || { tail -5 "$tmp/chromium.log"; die "chromium --dump-dom failed"; }
browser --window-size=960,680 --screenshot="$tmp/page.png" >/dev/null ||
  { tail -5 "$tmp/chromium.log"; die "chromium --screenshot failed"; }
kill -0 "$train_pid" 2>/dev/null || die "the run had ended before the browser looked: not a live test"
echo "[${SECONDS}s] DOM and screenshot taken while the run goes on"
kill "$train_pid"  # done looking (the checks below take a few seconds of Python)
[ -z "$keep" ] || cp "$tmp/page.png" "$keep"

python3 - "$tmp/dom.html" "$tmp/page.png" <<'EOF' || die "the page"
import collections, re, struct, sys, zlib

dom = open(sys.argv[1]).read()
assert re.search(r'id="state" class="running">running<', dom), "state is not 'running'"
assert re.search(r"step \d+ / 4000", dom), "no 'step N / 4000' line"
has_accuracy = True
for cid in ("c-loss", "c-acc", "c-lr", "c-gn"):
    m = re.search(r'<div id="%s"><svg.*?</svg>' % cid, dom, re.S)
    assert m, "no chart " + cid
    paths = re.findall(r'<path d="M[^"]*"', m.group(0))
    if cid == "c-acc" and not paths:
        print("note: no accuracy curve (the eval reports no token accuracy)")
        has_accuracy = False
        continue
    points = [p.count("L") + 1 for p in paths]
    # Train curves: a point per step (450 or more by now); eval curves: one per 200 steps.
    want = {"c-loss": [400, 2], "c-acc": [2], "c-lr": [400], "c-gn": [400]}[cid]
    assert len(points) == len(want) and all(n >= w for n, w in zip(points, want)), \
        "chart %s: curves of %s points, wanted at least %s" % (cid, points, want)

# Decode the PNG (8-bit RGB/RGBA, not interlaced: what Chromium writes) without libraries, and count
# every colour.
data = open(sys.argv[2], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat, hdr = 8, b"", None
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        hdr = struct.unpack(">IIBBBBB", body)
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
w, h, depth, ctype, _, _, interlace = hdr
assert depth == 8 and ctype in (2, 6) and interlace == 0, hdr
bpp = 3 if ctype == 2 else 4
raw = zlib.decompress(idat)
stride = w * bpp
prev = bytearray(stride)
hist = collections.Counter()
for y in range(h):
    f = raw[y * (stride + 1)]
    cur = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    if f == 1:  # Sub
        for i in range(bpp, stride): cur[i] = (cur[i] + cur[i - bpp]) & 255
    elif f == 2:  # Up
        cur = bytearray((x + p) & 255 for x, p in zip(cur, prev))
    elif f == 3:  # Average
        for i in range(bpp): cur[i] = (cur[i] + (prev[i] >> 1)) & 255
        for i in range(bpp, stride): cur[i] = (cur[i] + ((cur[i - bpp] + prev[i]) >> 1)) & 255
    elif f == 4:  # Paeth
        for i in range(bpp): cur[i] = (cur[i] + prev[i]) & 255
        for i in range(bpp, stride):
            a, b, c = cur[i - bpp], prev[i], prev[i - bpp]
            pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
            cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    hist.update(zip(cur[0::bpp], cur[1::bpp], cur[2::bpp]))
    prev = cur
colours = {"train loss": (0x2f, 0x6f, 0xdf), "eval loss": (0xe0, 0x69, 0x1a), "lr": (0x8a, 0x4f, 0xd0),
           "grad norm": (0xc2, 0x36, 0x6b)}
if has_accuracy:
    colours["token accuracy"] = (0x1f, 0x9d, 0x55)
counts = {name: sum(n for px, n in hist.items() if all(abs(px[k] - col[k]) <= 12 for k in range(3)))
          for name, col in colours.items()}
print("screenshot %dx%d: %d distinct colours; curve pixels: %s" % (w, h, len(hist), counts))
assert len(hist) > 50, "the screenshot is (nearly) blank"
# A legend swatch is 14 x 3 px (42); a drawn curve is hundreds, even early in the run.
for name in colours:
    assert counts.get(name, 0) > 150, "%s: %d pixels, no curve drawn" % (name, counts.get(name, 0))
EOF
echo "ok: the live page in headless Chromium during the run: charts drawn"
echo PASS
