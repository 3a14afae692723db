#!/bin/sh
# outlier_ppl.sh MODEL OUT.jsonl [WINDOWS] - perplexity of the EXPERIMENTAL key outlier-split
# probe (src/model/ops/exp_ksplit.c, on branch `outlier` only: build that branch first) against plain tq keys through the same simulation, the
# product's tq4 and the f32 cache, all in one run. V is the product's tq4 in every probe row.
# Plans (key channels chosen on window 60 of the text) come from build/exp_outlier_split.
# Environment: PLANS (default below) = C:hmode:hbits:lobits list; SEEDOFF = added to every
# group's sign seed (another rotation); NOREF=1 skips the f32 and tq4 rows.
set -e
M=$1; OUT=$2; W=${3:-16}
T=../shared/data/heldout-code.txt
P=${TMPDIR:-/tmp}/ksplit_plans.$$
mkdir -p "$P"
run() { # label, env plan (or ""), kv
    if [ -n "$2" ]; then
        TQKV_EXP_KSPLIT=$2 ./build/tqkv ppl --model "$M" --text $T --max-windows "$W" --kv "$3" --json 2>/dev/null | tail -1 | sed "s/^{/{\"label\":\"$1\",/" >> "$OUT"
    else
        ./build/tqkv ppl --model "$M" --text $T --max-windows "$W" --kv "$3" --json 2>/dev/null | tail -1 | sed "s/^{/{\"label\":\"$1\",/" >> "$OUT"
    fi
    tail -1 "$OUT" | cut -c1-120
}
if [ -z "$NOREF" ]; then
    run f32 "" f32
    run tq4 "" tq4
fi
for plan in ${PLANS:-0:0:0:3 0:0:0:4 0:0:0:5 32:0:4:3 16:0:5:4 32:0:5:4}; do
    ./build/exp_outlier_split --model "$M" --text $T --calib 60 --plan $plan --plan-out "$P/$plan.txt" >/dev/null 2>&1
    if [ -n "$SEEDOFF" ]; then
        awk -v o="$SEEDOFF" '{ $8 = $8 + o; print }' "$P/$plan.txt" > "$P/s.txt" && mv "$P/s.txt" "$P/$plan.txt"
    fi
    run "K_sim${SEEDOFF:+_s$SEEDOFF}_$plan" "$P/$plan.txt" f32/tq4
done
rm -rf "$P"
