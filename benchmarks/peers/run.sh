#!/usr/bin/env bash
# Peer DFlash trainers vs dflash-ipc on one H200: training tokens/s at SmolLM2-135M, Qwen3-8B and Qwen3.6-27B
# (16-layer slice) shapes, random weights, random tokens, documents of 2048 or mixed lengths. On the GPU machine,
# from the project's root, with the wheels in .whl-peers/ (README.md):
#   STAGE=specforge bash benchmarks/peers/run.sh                 # ~160 s, SmolLM2 and 8B
#   STAGE=ipc SHAPES=smollm2 bash benchmarks/peers/run.sh        # ~260 s
#   STAGE=ipc SHAPES=qwen3-8b bash benchmarks/peers/run.sh       # ~410 s
# Stages: setup (wheels, imports, what the image lacks), specforge (SpecForge 0.2.0's DFlash step behind an
# in-process HF target), ipc (dflash-ipc's `bench pipeline`, target and drafter sharing cuda:0), zlab (z-lab's
# decoder on a dflash-ipc export, CPU-sized), all (specforge then ipc: more than one call's 600 s at both shapes),
# tau (τ at equal training seconds on real data: dflash-ipc's run and SpecForge's step, both drafters decoded by
# `dflash-ipc eval --suite`; README.md "τ per GPU-minute"; results to $RESULTS_DIR/tau.json, not results.jsonl).
# Every stage runs setup first (seconds) and makes what it needs, so each call stands alone on a fresh machine;
# WORK (/root/peer-bench) keeps the random checkpoints across calls while the machine stays warm.
# Knobs: SHAPES ("smollm2 qwen3-8b"; also qwen3.6-27b), LENGTHS (fixed | mixed: shapes.doc_lengths), SF_STEPS (20),
# SF_WARMUP (5), SF_ARGS (more specforge_bench.py flags), IPC_VARIANTS ("parity native"), IPC_LEVERS (on | off:
# gen_ipc_config.py), IPC_STEPS (30 SmolLM2 / 20 8B and 27B), IPC_BENCH (forward-only,cuda-ipc),
# IPC_SET (gen_ipc_config.py --set overrides, e.g. "drafter.anchor_chunk=0 training.ce_chunk_tokens=16384"),
# FP8_LINEARS (rowwise | tensorwise: dflash-ipc's drafter.fp8_linears, torchao's wheel in WHL; SpecForge unchanged),
# BUDGET_S (570), SITE (/tmp/site: the wheels' --target), PROJ (.: the dflash-ipc checkout), WHL (PROJ/.whl-peers), SEQ (2048), IPC_DEVICE (cuda:0).
# CPU smoke (tiny shapes): SHAPES=tiny-llama SEQ=256 IPC_DEVICE=cpu IPC_STEPS=4 \
#   SF_ARGS="--attention sdpa --num-anchors 16 --device cpu" SF_STEPS=3 SF_WARMUP=1 bash benchmarks/peers/run.sh
# tau knobs: TAU_CONFIG (configs/smollm2-1gpu-synth.toml: its model and gen-data files must exist; "tiny": a tiny
# random Llama, random-token records and a held-out file made in TAU_DIR, for a CPU run), TAU_SUITE (eval's
# --suite; default the example's four sets), TAU_DIR ($WORK/tau; every part there resumes: a rerun skips what is
# done), TRAIN_S (120: the dflash-ipc run's training.max_seconds; SpecForge then trains as many seconds as that run
# recorded), IPC_RUN (a dflash-ipc run directory trained before, e.g. runs/smollm2-1gpu-synth: reused, not
# trained), TAU_SET (--set items for both trainers and eval, space-separated), SF_TAU_ARGS (more
# specforge_tau.py flags), EVAL_N (16 prompts per set), EVAL_MAX_NEW (128), EVAL_WORKERS (4 per drafter), TAU_EVAL
# ("ipc specforge": the drafters to decode in this call, at once; "none": train only). CPU: TAU_CONFIG=tiny TRAIN_S=5
# EVAL_N=2 EVAL_MAX_NEW=16 EVAL_WORKERS=1 STAGE=tau SKIP_SETUP=1 bash benchmarks/peers/run.sh (python3: the venv's)
# Results: $RESULTS_DIR/results.jsonl (one JSON line per measurement), $RESULTS_DIR/<stage>.log, $RESULTS_DIR/ipc-variants.jsonl;
# a table at the end (summarize.py).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
HERE=$(cd "$(dirname "$0")" && pwd)
PROJ=$(cd "${PROJ:-.}" 2>/dev/null && pwd || echo "")
WHL=${WHL:-${PROJ:+$PROJ/.whl-peers}}
WORK=${WORK:-/root/peer-bench}
SITE=${SITE:-/tmp/site}  # where the wheels are installed (--target)
RESULTS_DIR=${RESULTS_DIR:-/tmp/peers-out}
SHAPES=${SHAPES:-"smollm2 qwen3-8b"}
STAGE=${STAGE:-all}
LENGTHS=${LENGTHS:-fixed}
mkdir -p "$RESULTS_DIR" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

setup() {
  stamp "setup: wheels from ${WHL:-<none>} into $SITE"
  if [ -n "$PROJ" ] && ls "$PROJ"/.whl/*.whl >/dev/null 2>&1; then  # the project's own wheels, when its checkout has them
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE "$PROJ"/.whl/*.whl || return 1
  fi
  if [ -n "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE "$WHL"/*.whl || return 1
  else
    echo "no wheels in '$WHL' (stage specforge-0.2.0, dflash-0.1.0, pyzmq, setproctitle there: README.md)"; return 1
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  if [ -n "$PROJ" ]; then  # dflash-ipc importable, dflash_ipc.procs included (as tools/gpu_setup.sh does)
    if ! (cd "$PROJ" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$RESULTS_DIR/install.log" 2>&1); then
      echo "editable install failed (install.log): dflash_ipc.procs by a link"
      ln -sfn ../procs "$PROJ/dflash_ipc/procs"
      export PYTHONPATH=$PYTHONPATH:$PROJ
    fi
  fi
  python3 - <<'PY'
import importlib, importlib.util, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
have = {m: importlib.util.find_spec(m) is not None for m in
        ("specforge", "dflash", "dflash_ipc", "zmq", "setproctitle", "accelerate", "pydantic", "datasets", "sglang", "vllm",
         "fla", "flash_attn", "yunchang", "wandb", "openai", "hs_connectors", "speculators", "torchao")}
print("importable:", " ".join(f"{k}={'y' if v else 'n'}" for k, v in have.items()))
import specforge.algorithms.common.dflash_family_model, specforge.training.backend, specforge.optimizer  # noqa: E401,F401
print("specforge DFlash training path imports OK")
PY
}

specforge_stage() {
  for shape in $SHAPES; do
    [ "$(left)" -lt 60 ] && { stamp "budget: skip specforge $shape"; continue; }
    stamp "specforge $shape"
    timeout -s INT $(( $(left) - 10 )) python3 "$HERE/specforge_bench.py" --shape "$shape" --steps "${SF_STEPS:-20}" \
      --warmup "${SF_WARMUP:-5}" --seq-len "${SEQ:-2048}" --lengths "$LENGTHS" ${SF_ARGS:-} --out "$WORK/sf-$shape.json" > "$WORK/sf-$shape.log" 2>&1
    grep -v "Warning\|warnings.warn" "$WORK/sf-$shape.log" | tail -n 30
    if [ ! -s "$WORK/sf-$shape.json" ] && grep -q "OutOfMemory\|out of memory" "$WORK/sf-$shape.log" && [ "$(left)" -gt 90 ]; then
      b=$(python3 -c "import sys; sys.path.insert(0, '$HERE'); from shapes import SHAPES; print(SHAPES['$shape']['drafter']['batch'] // 2)")
      stamp "specforge $shape: out of memory, again at batch $b"
      timeout -s INT $(( $(left) - 10 )) python3 "$HERE/specforge_bench.py" --shape "$shape" --steps "${SF_STEPS:-20}" --batch "$b" \
        --warmup "${SF_WARMUP:-5}" --seq-len "${SEQ:-2048}" --lengths "$LENGTHS" ${SF_ARGS:-} --out "$WORK/sf-$shape.json" 2>&1 \
        | grep -v "Warning\|warnings.warn" | tail -n 12
    fi
    [ -s "$WORK/sf-$shape.json" ] && cat "$WORK/sf-$shape.json" >> "$RESULTS_DIR/results.jsonl" && rm -f "$WORK/sf-$shape.json"
  done
}

ipc_stage() {
  [ -n "$PROJ" ] || { echo "PROJ: no dflash-ipc checkout"; return 1; }
  data="$WORK/data-$LENGTHS.jsonl"
  if [ "$LENGTHS" = mixed ]; then
    [ -s "$data" ] || python3 "$HERE/make_data.py" --out "$data" --n 6000 --lengths mixed --seq-len "${SEQ:-2048}"
  else
    [ -s "$data" ] || python3 "$HERE/make_data.py" --out "$data" --n 256 --len $(( ${SEQ:-2048} + 52 ))
  fi
  for shape in $SHAPES; do
    [ "$(left)" -lt 90 ] && { stamp "budget: skip ipc $shape"; continue; }
    stamp "make_target $shape"
    python3 "$HERE/make_target.py" --shape "$shape" --out "$WORK/$shape" --device "${IPC_DEVICE:-cuda:0}" || continue
    case $shape in qwen3*) steps=${IPC_STEPS:-20} ;; *) steps=${IPC_STEPS:-30} ;; esac
    for variant in ${IPC_VARIANTS:-parity native}; do
      [ "$(left)" -lt 90 ] && { stamp "budget: skip ipc $shape/$variant"; continue; }
      cfg="$WORK/$shape-$variant-$LENGTHS.toml"
      python3 "$HERE/gen_ipc_config.py" --shape "$shape" --variant "$variant" --model "$WORK/$shape" --data "$data" --out "$cfg" \
        --device "${IPC_DEVICE:-cuda:0}" --seq-len "${SEQ:-2048}" --lengths "$LENGTHS" --levers "${IPC_LEVERS:-on}" \
        --fp8-linears "${FP8_LINEARS:-none}" ${IPC_SET:+--set $IPC_SET}
      stamp "dflash-ipc bench pipeline $shape/$variant ($steps steps, ${IPC_BENCH:-forward-only,cuda-ipc})"
      (cd "$PROJ" && timeout -s INT $(( $(left) - 10 )) python3 -m dflash_ipc.cli bench pipeline --config "$cfg" --steps "$steps" \
        --variants "${IPC_BENCH:-forward-only,cuda-ipc}" --out "$RESULTS_DIR/ipc-variants.jsonl" --json 2>"$WORK/ipc-$shape-$variant-$LENGTHS.err" \
        | tail -1 > "$WORK/ipc-$shape-$variant-$LENGTHS.json")
      echo "bench rc $?"; grep -E "FAILED|Error|error:" "$WORK/ipc-$shape-$variant-$LENGTHS.err" | tail -5
      python3 - "$WORK/ipc-$shape-$variant-$LENGTHS.json" "$shape" "$variant${FP8_LINEARS:+ +fp8-$FP8_LINEARS}${IPC_SET:+ +${IPC_SET// /,}}" "$cfg" "$LENGTHS" "${IPC_LEVERS:-on}" >> "$RESULTS_DIR/results.jsonl" <<'PY'
import json, sys, tomllib
path, shape, variant, cfg_path, lengths, levers = sys.argv[1:7]
cfg = tomllib.load(open(cfg_path, "rb"))
docs = cfg["data"]["max_batch_size"]  # fixed lengths: every batch; mixed: at most (short documents hold fewer anchors)
anchors = min(cfg["data"]["token_budget"], docs * min(cfg["drafter"]["num_anchors"], cfg["data"]["max_seq_len"] - 1))
if cfg["drafter"].get("max_anchors_per_batch"):
    anchors = min(anchors, cfg["drafter"]["max_anchors_per_batch"])
tag = {"trainer": "dflash-ipc", "shape": shape, "variant": variant, "lengths": lengths, "levers": levers,
       "anchors_per_step": anchors, "drafter_cfg": cfg["drafter"],
       "tokens_per_step": cfg["data"]["token_budget"], "seq_len": cfg["data"]["max_seq_len"]}  # mixed: at most
try:
    r = json.loads(open(path).read())
except Exception as e:  # a run cut short: its variants are in ipc-variants.jsonl
    print(json.dumps(tag | {"error": f"no summary ({e})"})); sys.exit()
print(json.dumps(r | tag))
PY
      tail -c 1500 "$WORK/ipc-$shape-$variant-$LENGTHS.err"
    done
  done
  cat "$WORK"/ipc-*.err > "$RESULTS_DIR/ipc-stderr.log" 2>/dev/null
}

zlab_stage() {  # z-lab's decoder on a dflash-ipc export: tiny shapes, CPU (see README)
  W=$WORK/zlab; mkdir -p "$W"
  python3 "$HERE/make_target.py" --shape tiny-llama --out "$W/tiny-llama" --device cpu
  python3 "$HERE/make_data.py" --out "$W/data.jsonl" --n 16 --len 300
  python3 "$HERE/gen_ipc_config.py" --shape tiny-llama --variant parity --model "$W/tiny-llama" --data "$W/data.jsonl" \
    --device cpu --seq-len 256 --out "$W/tiny.toml"
  (cd "$PROJ" && python3 -m dflash_ipc.cli export-untrained --config "$W/tiny.toml" --out "$W/export") | tail -1
  python3 "$HERE/zlab_check.py" --target "$W/tiny-llama" --drafter "$W/export" --max-new 32 --prompts 2 2>/dev/null \
    | grep '^{' >> "$RESULTS_DIR/results.jsonl"
}

tau_tiny() {  # a tiny real-data stand-in for the CPU: random Llama + word-level tokenizer, random-token records
  python3 "$HERE/make_target.py" --shape tiny-llama --out "$1/tiny-llama" --device cpu | tail -1
  python3 "$HERE/make_data.py" --out "$1/data.jsonl" --n 64 --len 200
  python3 "$HERE/make_data.py" --out "$1/data.holdout.jsonl" --n 8 --len 60 --seed 1
  python3 "$HERE/gen_ipc_config.py" --shape tiny-llama --variant native --model "$1/tiny-llama" --data "$1/data.jsonl" \
    --device cpu --seq-len 256 --out "$1/tiny.toml" --set training.export_on_finish=true
}

tau_stage() {  # τ at equal training seconds on one config's data: dflash-ipc's run, then SpecForge's step (README)
  [ -n "$PROJ" ] || { echo "PROJ: no dflash-ipc checkout"; return 1; }
  W=${TAU_DIR:-$WORK/tau}; mkdir -p "$W"; W=$(cd "$W" && pwd)
  cfg=${TAU_CONFIG:-configs/smollm2-1gpu-synth.toml}
  suite=${TAU_SUITE:-synth=data/smollm2-synth.holdout.jsonl,builtin=data/smollm2-builtin.holdout.jsonl,humaneval,everyday=configs/eval/everyday.jsonl}
  if [ "$cfg" = tiny ]; then
    [ -s "$W/tiny.toml" ] || tau_tiny "$W" || return 1
    cfg=$W/tiny.toml suite=${TAU_SUITE:-synth=$W/data.holdout.jsonl,everyday=configs/eval/everyday.jsonl}
  fi
  sets=(--set "data.cache_dir=\"$W/data-cache\"")  # both tokenize the records once, into one cache
  for s in ${TAU_SET:-}; do sets+=(--set "$s"); done
  run=$(cd "$PROJ" && realpath -m "${IPC_RUN:-$W/ipc-run}")
  if [ -s "$run/export/drafter/config.json" ]; then
    stamp "tau: the dflash-ipc drafter of $run (trained before)"
  else
    stamp "tau: dflash-ipc up --config $cfg, ${TRAIN_S:-120} s of training steps -> $run"
    (cd "$PROJ" && timeout -s INT $(( $(left) - 10 )) python3 -m dflash_ipc.cli up --config "$cfg" "${sets[@]}" \
      --set "training.max_seconds=${TRAIN_S:-120}" --run-dir "$run" --resume) > "$W/ipc-up.log" 2>&1
    echo "up rc $?"; grep -A6 "^\[up\] finished\|^\[up\] stopped" "$W/ipc-up.log" || tail -n 15 "$W/ipc-up.log"
  fi
  [ -s "$run/export/drafter/config.json" ] || { echo "no dflash-ipc export in $run/export/drafter ($W/ipc-up.log)"; return 1; }
  if [ ! -s "$W/specforge/train.json" ]; then
    stamp "tau: SpecForge's step for as many seconds as $run trained"
    (cd "$PROJ" && timeout -s INT $(( $(left) - 10 )) python3 "$HERE/specforge_tau.py" --config "$cfg" "${sets[@]}" \
      --train-s-from "$run" --out "$W/specforge" ${SF_TAU_ARGS:-}) > "$W/specforge.log" 2>&1
    echo "specforge rc $?"; grep "^\[specforge\]\|Error" "$W/specforge.log" | tail -n 8
  fi
  [ -s "$W/specforge/train.json" ] || { echo "no SpecForge drafter ($W/specforge.log)"; return 1; }
  stamp "tau: eval --suite $suite, both drafters at once (${EVAL_N:-16} prompts per set, max-new ${EVAL_MAX_NEW:-128})"
  for who in ${TAU_EVAL:-ipc specforge}; do
    [ "$who" = ipc ] && d=$run/export/drafter || d=$W/specforge/export
    [ -s "$W/eval-$who.json" ] && continue
    [ "$(left)" -lt 60 ] && { stamp "budget: skip eval $who"; continue; }
    (cd "$PROJ" && timeout -s INT $(( $(left) - 5 )) python3 -m dflash_ipc.cli eval --config "$cfg" "${sets[@]}" --drafter "$d" \
      --suite "$suite" --n "${EVAL_N:-16}" --max-new "${EVAL_MAX_NEW:-128}" --workers "${EVAL_WORKERS:-4}" --json \
      > "$W/eval-$who.part" 2> "$W/eval-$who.log"; echo "eval $who rc $? (1: not lossless)"
      grep -q '^{' "$W/eval-$who.part" && mv "$W/eval-$who.part" "$W/eval-$who.json" || tail -n 5 "$W/eval-$who.log") &
  done
  wait
  for who in ipc specforge; do [ -s "$W/eval-$who.json" ] || { echo "no eval of the $who drafter yet: run again"; return 0; }; done
  python3 "$HERE/tau_table.py" --ipc-eval "$W/eval-ipc.json" --sf-eval "$W/eval-specforge.json" --ipc-run "$run" \
    --sf-train "$W/specforge/train.json" --json-out "$RESULTS_DIR/tau.json"
}

if [ "${SKIP_SETUP:-0}" = 1 ]; then  # a caller that ran setup already (gpu_run.sh)
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  setup > "$RESULTS_DIR/setup.log" 2>&1; rc=$?; cat "$RESULTS_DIR/setup.log"; [ $rc -eq 0 ] || { echo "setup failed"; exit 1; }
fi
case $STAGE in
  setup) ;;
  none) ;;
  specforge) specforge_stage 2>&1 | tee "$RESULTS_DIR/specforge.log" ;;
  ipc) ipc_stage 2>&1 | tee "$RESULTS_DIR/ipc.log" ;;
  zlab) zlab_stage 2>&1 | tee "$RESULTS_DIR/zlab.log" ;;
  tau) tau_stage 2>&1 | tee "$RESULTS_DIR/tau.log" ;;
  all) specforge_stage 2>&1 | tee "$RESULTS_DIR/specforge.log"; ipc_stage 2>&1 | tee "$RESULTS_DIR/ipc.log" ;;
  *) echo "unknown STAGE=$STAGE (setup, specforge, ipc, zlab, tau, all)"; exit 2 ;;
esac
[ -s "$RESULTS_DIR/results.jsonl" ] && python3 "$HERE/summarize.py" "$RESULTS_DIR/results.jsonl"
stamp "done"
