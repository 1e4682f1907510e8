#!/usr/bin/env bash
# Writes .dvc/plots/offline.html: DVC's plots page template with vega, vega-lite and vega-embed inlined, so
# `dvc plots show` and `dvc plots diff` draw without a network (DVC's own page loads them from a CDN).
# The versions are the ones DVC's page asks the CDN for (dvc_render/vega.py); their licenses go beside it.
#   bash scripts/vendor_vega.sh        # needs npm and the npm registry; the result is committed
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2)
BUILDS=(vega.min.js vega-lite.min.js vega-embed.min.js)
out=.dvc/plots
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
: >"$tmp/scripts"
: >"$tmp/licenses"
for i in "${!PACKAGES[@]}"; do
  (cd "$tmp" && npm pack --silent "${PACKAGES[$i]}" >/dev/null)
  name=${PACKAGES[$i]%@*}
  mkdir -p "$tmp/$name" && tar xzf "$tmp/$name"-*.tgz -C "$tmp/$name"
  { echo "<script>/* ${PACKAGES[$i]}: ${BUILDS[$i]}, BSD-3-Clause (vega-licenses.txt) */"
    cat "$tmp/$name/package/build/${BUILDS[$i]}"
    echo "</script>"; } >>"$tmp/scripts"
  { echo "== ${PACKAGES[$i]} (npm) =="; cat "$tmp/$name/package/LICENSE"; echo; } >>"$tmp/licenses"
done
# DVC fills {plot_divs} (and {refresh_tag}); leaving out {scripts} leaves out its CDN <script> tags.
"${PYTHON:-python3}" - "$tmp/scripts" "$out/offline.html" <<'PYEOF'
import sys
scripts = open(sys.argv[1]).read()
page = f"""<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>DVC Plot</title>
{scripts}
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(page)
PYEOF
mv "$out/offline.html.tmp" "$out/offline.html"
cp "$tmp/licenses" "$out/vega-licenses.txt"
echo "wrote $out/offline.html ($(wc -c <"$out/offline.html") bytes) and $out/vega-licenses.txt"
