#!/bin/bash
# tools/quality_report.sh: regenerate docs/QUALITY.md's table lines and plot from the committed
# runs (bench/quality/*.jsonl): docs/quality.png and, on stdout, the markdown table.
# As root it installs python3-matplotlib when missing (scripts/deps.sh plot).
# The runs themselves: tools/quality_runs.sh OUT.jsonl [48 16] (hours on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh plot
PY=python3; [ -x /usr/bin/python3 ] && PY=/usr/bin/python3  # Debian's, where apt puts matplotlib
$PY tools/quality_plot.py docs/quality.png bench/quality/*.jsonl >&2
$PY tools/quality_table.py bench/quality/*.jsonl
