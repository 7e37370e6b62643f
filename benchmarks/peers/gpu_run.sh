#!/usr/bin/env bash
# One GPU call on one H200 (at most TOTAL_S seconds, default 530): a check that same-GPU ring slots read in place
# keep every byte (ring-in-place; on failure the trainer pieces copy slots out), the drafter step by op class at Qwen3-8B and
# Qwen3.6-27B widths, then dflash-ipc against SpecForge 0.2.0 (run.sh) at Qwen3-8B 4,096 anchors (parity and
# native), then SmolLM2-135M, then the Qwen3.6-27B slice, each piece only while the time left covers its estimate
# (the measurements in results-h200-2026-12-03.jsonl), each under its own hard timeout. Logs and JSON under $RESULTS_DIR;
# a compact table at the end. From the project's root, wheels in .whl-peers/ (README.md):
#   bash benchmarks/peers/gpu_run.sh
# Knobs: PLAN (the pieces in order, default below), LENGTHS (fixed | mixed, for the trainer pieces), TOTAL_S,
# IPC_LEVERS (on | off), FP8_LINEARS (rowwise | tensorwise: the ipc pieces' drafter.fp8_linears, torchao's wheel in
# .whl-peers/; SpecForge's side unchanged), RESULTS_DIR, WORK. Pieces fp8-8b / fp8-27b (not in the default PLAN): the
# drafter step compiled, bf16 against FP8 linears (FP8_LINEARS, default rowwise), in one bench. A second call can
# take what the first skipped, e.g.
#   PLAN="sf-smollm2 ipc-smollm2 sf-27b ipc-27b" bash benchmarks/peers/gpu_run.sh
#   LENGTHS=mixed PLAN="sf-8b ipc-8b" bash benchmarks/peers/gpu_run.sh
#   PLAN="fp8-8b fp8-27b" bash benchmarks/peers/gpu_run.sh; FP8_LINEARS=rowwise PLAN="ipc-8b ipc-27b" bash benchmarks/peers/gpu_run.sh
# CE_FP8=1: training.ce_fp8 (the CE's head GEMMs in e4m3) in the dflash-ipc pieces (their rows carry +training.ce_fp8=true),
# and the drafter-step profiles time it beside bf16 (variants eager,eager+ce-fp8), e.g.
#   CE_FP8=1 PLAN="profile-8b profile-27b sf-8b ipc-8b" bash benchmarks/peers/gpu_run.sh
set -u
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-530}
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
HERE=$(cd "$(dirname "$0")" && pwd)
export PROJ=$(pwd) RESULTS_DIR=${RESULTS_DIR:-/tmp/gpu-run} WORK=${WORK:-/root/peer-bench} SITE=${SITE:-/tmp/site}
export WHL=${WHL:-$PROJ/.whl-peers} LENGTHS=${LENGTHS:-fixed} IPC_LEVERS=${IPC_LEVERS:-on}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CE_FP8_SET=""
if [ "${CE_FP8:-0}" = 1 ]; then  # the FP8 loss head: beside bf16 in the drafter-step profiles, labelled in the trainer rows
  export CE_FP8_STEP=",eager+ce-fp8"; CE_FP8_SET="training.ce_fp8=true"
  case " ${IPC_SET:-} " in *" $CE_FP8_SET "*) ;; *) export IPC_SET="$CE_FP8_SET${IPC_SET:+ $IPC_SET}" ;; esac
fi
PLAN=${PLAN:-"ring-in-place profile-8b profile-27b sf-8b ipc-8b sf-smollm2 ipc-smollm2 sf-27b ipc-27b"}
case " $PLAN " in *" setup "*) ;; *) PLAN="setup $PLAN" ;; esac  # a fresh machine: the wheels first, always
mkdir -p "$RESULTS_DIR" "$WORK"
export PYTHONPATH=$SITE:$PROJ${PYTHONPATH:+:$PYTHONPATH}  # the wheels (setup installs them there) and this checkout

# seconds each piece needs (estimates from the earlier H200 results, compile warm-ups included); skipped below that
declare -A NEED=([setup]=30 [ring-in-place]=25 [profile-8b]=50 [profile-27b]=70 [sf-8b]=70 [ipc-8b]=200 [sf-smollm2]=50 [ipc-smollm2]=140
                 [sf-27b]=90 [ipc-27b]=200 [fp8-8b]=230 [fp8-27b]=260)
# hard cap per piece (its timeout), never beyond the time left
declare -A CAP=([setup]=150 [ring-in-place]=90 [profile-8b]=120 [profile-27b]=150 [sf-8b]=120 [ipc-8b]=330 [sf-smollm2]=90 [ipc-smollm2]=240
                [sf-27b]=160 [ipc-27b]=300 [fp8-8b]=300 [fp8-27b]=340)

drafter_cfg() {  # a config of the shape for `bench drafter-step` (--random-target: no checkpoint is read)
  CE_FP8=0 python3 "$HERE/gen_ipc_config.py" --shape "$1" --variant parity --model "$WORK/$1" --data "$WORK/none.jsonl" \
    --out "$WORK/step-$1.toml" --levers "$IPC_LEVERS" > /dev/null
}

piece() {  # the command of one piece, run under its timeout
  case $1 in
    setup) STAGE=setup bash "$HERE/run.sh" ;;
    ring-in-place)  # same-GPU slots read in place, every byte verified under races; a failure turns it off below
      python3 -c 'import json, sys; from dflash_ipc.bench.gpu_ring import in_place_check
rs = in_place_check("cuda-ipc", 0)
print("\n".join(json.dumps({k: r.get(k) for k in ("name", "copy_mode", "slots", "iters", "errors", "stray_frees", "ok")}) for r in rs))
sys.exit(0 if all(r["ok"] and r["copy_mode"] == "same-device" for r in rs) else 1)' || { touch "$RESULTS_DIR/in-place-failed"; return 1; }
      ;;
    profile-8b | profile-27b)
      local shape=qwen3-8b; [ "$1" = profile-27b ] && shape=qwen3.6-27b
      drafter_cfg "$shape"
      # eager: the op classes as they are; anchor_chunk "auto" picks the chunk for this GPU (the drafter alone on it)
      python3 -m dflash_ipc.cli bench drafter-step --config "$WORK/step-$shape.toml" --random-target --target-shape "$shape" \
        --variants "eager${CE_FP8_STEP:-}" --steps 2 --batches 1 --doc-len 2048 --supervised 0.7 --profile --device cuda:0 \
        --out "$RESULTS_DIR/drafter-step-$shape.json" ;;
    fp8-8b | fp8-27b)  # the compiled step, bf16 then FP8 linears, same weights and batches (ratios: bf16 / fp8)
      local shape=qwen3-8b; [ "$1" = fp8-27b ] && shape=qwen3.6-27b
      drafter_cfg "$shape"
      python3 -m dflash_ipc.cli bench drafter-step --config "$WORK/step-$shape.toml" --random-target --target-shape "$shape" \
        --variants "compile,compile+fp8-${FP8_LINEARS:-rowwise}" --steps 4 --batches 2 --doc-len 2048 --supervised 0.7 --profile \
        --device cuda:0 --out "$RESULTS_DIR/drafter-step-fp8-$shape.json" ;;
    sf-*) SKIP_SETUP=1 STAGE=specforge SHAPES=$(shape_of "$1") SF_STEPS=${SF_STEPS:-12} SF_WARMUP=${SF_WARMUP:-4} \
            BUDGET_S=$2 bash "$HERE/run.sh" ;;
    ipc-*)
      local t=$(date +%s) shape; shape=$(shape_of "$1")
      if [ -f "$RESULTS_DIR/in-place-failed" ]; then  # the ring check above failed: copy slots out as before
        export IPC_SET="transport.drafter_in_place=false${IPC_SET:+ $IPC_SET}"; echo "== in-place reads off (ring-in-place failed)"
      fi
      SKIP_SETUP=1 STAGE=ipc SHAPES=$shape IPC_BENCH=${IPC_BENCH:-cuda-ipc} IPC_STEPS=${IPC_STEPS:-12} BUDGET_S=$2 bash "$HERE/run.sh"
      # a failed parity run with the new options on: once more without in-place slots and the automatic chunk,
      # so the comparison still gets a figure (its row says which options it ran with)
      if [ "$IPC_LEVERS" = on ] && tail -n 4 "$RESULTS_DIR/results.jsonl" 2>/dev/null | grep "\"shape\": \"$shape\"" | grep -q '"error"'; then
        echo "== $shape: a run with the new options failed; parity again with transport.drafter_in_place=false drafter.anchor_chunk=1024"
        SKIP_SETUP=1 STAGE=ipc SHAPES=$shape IPC_VARIANTS=parity IPC_BENCH=${IPC_BENCH:-cuda-ipc} IPC_STEPS=${IPC_STEPS:-12} \
          IPC_SET="transport.drafter_in_place=false drafter.anchor_chunk=1024${CE_FP8_SET:+ $CE_FP8_SET}" BUDGET_S=$(( $2 - $(date +%s) + t )) bash "$HERE/run.sh"
      fi ;;
    *) echo "unknown piece $1" ; return 2 ;;
  esac
}

shape_of() { case ${1#*-} in 8b) echo qwen3-8b ;; 27b) echo qwen3.6-27b ;; *) echo "${1#*-}" ;; esac; }

# one piece, re-entered under `timeout` (its own process group: the timeout's signal reaches every child)
if [ "${1:-}" = __piece ]; then piece "$2" "$3"; exit $?; fi

stamp "plan: $PLAN (lengths $LENGTHS, levers $IPC_LEVERS, $TOTAL_S s)${IPC_SET:+; IPC_SET $IPC_SET}"
nvidia-smi --query-gpu=name,memory.used,memory.total,compute_mode --format=csv,noheader 2>&1 | head -2
for p in $PLAN; do
  need=${NEED[$p]:-60}
  if [ "$(left)" -lt "$need" ]; then stamp "skip $p: $(left) s left, needs ~$need"; echo "$p skipped" >> "$RESULTS_DIR/pieces.txt"; continue; fi
  cap=${CAP[$p]:-120}; [ "$cap" -gt "$(( $(left) - 20 ))" ] && cap=$(( $(left) - 20 ))  # 15 s of -k and the table
  stamp "$p (timeout $cap s)"
  t=$(date +%s)
  timeout -s INT -k 15 "$cap" bash "$0" __piece "$p" "$(( cap - 5 ))" > "$RESULTS_DIR/$p.log" 2>&1; rc=$?
  echo "$p rc $rc $(( $(date +%s) - t )) s" | tee -a "$RESULTS_DIR/pieces.txt"
  grep -v "Warning\|warnings.warn" "$RESULTS_DIR/$p.log" | grep -E "error|Error|FAILED|OutOfMemory|rc |tok/s|step [0-9]+/|auto:" | tail -n 8
  if [ "$p" = setup ] && [ "$rc" -ne 0 ]; then tail -n 30 "$RESULTS_DIR/setup.log" "$RESULTS_DIR/$p.log"; echo "setup failed: nothing else can run"; exit 1; fi
done
stamp "table"
python3 - "$RESULTS_DIR" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "drafter-step-*.json"))):
    r = json.load(open(path))
    for name, v in r.get("variants", {}).items():
        m = v["median_s"]
        print(f"drafter step {os.path.basename(path)[13:-5]} {name}: {m['step']:.3f} s (prep {m['prep']:.3f}, forward {m['forward']:.3f}, "
              f"loss {m['loss']:.3f}, backward {m['backward']:.3f}, optimizer {m['optimizer']:.3f}); "
              f"{v['blocks_per_batch']:.0f} anchors, chunk {v.get('anchor_chunk')}; {v['gemm_tflops_per_s']} TFLOP/s of matmuls; "
              f"FP8 linears {v.get('fp8_linear_layers', 0)}; loss_step0 {v['loss_step0']:.5f}; "
              f"head {v['lm_head_share_of_gemm_flops']:.0%} of matmul FLOPs; mps {r.get('mps', {}).get('active')}")
        classes = r.get("profile", {}).get(name, {}).get("classes", {})
        if classes:
            print("   by op class: " + ", ".join(f"{k} {c['pct']:.0f}%" for k, c in list(classes.items())[:8]))
PY
[ -s "$RESULTS_DIR/results.jsonl" ] && python3 "$HERE/summarize.py" "$RESULTS_DIR/results.jsonl"
cat "$RESULTS_DIR/pieces.txt"
stamp "done"
