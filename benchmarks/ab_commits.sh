#!/usr/bin/env bash
# The same `freescale train` run on the src trees of several commits, one after another in
# one device call: which commit moved a mode's QPS? (a bisect across the GPU machine's
# stale .git: the trees are extracted here and travel as untracked files)
#   bash benchmarks/ab_commits.sh extract 40571f4 0765dec   # here: writes _ab/<sha>/src
#   OUT=... bash benchmarks/ab_commits.sh run               # on the GPU machine
# Runs, in order: head, each extracted commit, head again, head vanilla, the first commit
# again (the repeats show the run-to-run spread next to the commit-to-commit one).
# Writes $OUT/bisect.log (QPS, stage ms, host CPU per run). MODE, S (steps), NPROC (GPUs,
# default 2) and LIMIT (seconds per run, default 100) override.
set -u
case "${1:-}" in
extract)
  shift; rm -rf _ab
  for c in "$@"; do mkdir -p "_ab/$c" && git archive "$c" src | tar -x -C "_ab/$c"; done
  ls _ab
  ;;
run)
  : "${OUT:?set OUT}"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  S=${S:-500}; MODE=${MODE:-freescale}; NPROC=${NPROC:-2}; LIMIT=${LIMIT:-100}
  one() {  # name srcdir mode
    echo "=== $1 mode=$3 $(date +%T)" >> "$OUT/bisect.log"
    PYTHONPATH=$2 timeout "$LIMIT" python -m freescale.cli train --device cuda --nproc "$NPROC" --steps "$S" \
      --mode "$3" --timing events --zipf-s 0.6 --eval-every 0 --no-progress > "/tmp/b_$1_$3.log" 2>&1
    echo "rc=$?" >> "$OUT/bisect.log"
    grep -E "QPS|per step|host CPU|stage|Error" "/tmp/b_$1_$3.log" | head -12 >> "$OUT/bisect.log"
    grep -E "QPS" "/tmp/b_$1_$3.log" | head -1 | sed "s/^/$1 $3: /"
  }
  commits=$(ls _ab | grep -v '\.sh$')
  one head src "$MODE"
  for c in $commits; do one "$c" "_ab/$c/src" "$MODE"; done
  one head2 src "$MODE"
  one head src vanilla
  first=$(echo "$commits" | head -1); one "${first}b" "_ab/$first/src" "$MODE"
  ;;
*) echo "usage: $0 extract SHA... | run" >&2; exit 2 ;;
esac
