#!/usr/bin/env bash
# usage: run_case.sh ID TIMEOUT_S COMMAND...   (run from /work/main; records rc, seconds, output tail)
# output: out/ID.txt (full stdout+stderr), a line in results.tsv: id \t rc \t seconds \t command
set -u
id=$1; to=$2; shift 2
here=/work/main/scripts/soundness_probe/audit_2026_12_07_cli
cd /work/main
t0=$(date +%s.%N)
timeout -k 5 "$to" bash -c "$*" > "$here/out/$id.txt" 2>&1
rc=$?
t1=$(date +%s.%N)
secs=$(python3 -c "print(f'{$t1-$t0:.1f}')")
printf '%s\t%s\t%s\t%s\n' "$id" "$rc" "$secs" "$*" >> "$here/results.tsv"
echo "=== $id rc=$rc ${secs}s :: $*"
tail -n ${TAILN:-4} "$here/out/$id.txt" | cut -c1-400
