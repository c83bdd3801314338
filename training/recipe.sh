#!/usr/bin/env bash
# The shipped demo policy's recipe, from scratch, in three stages (docs/history.md, "The demo
# policy"):
#   1. the lookup alone: the instruction drawn over the objects in view, only it and the
#      newest detections rendered (a 4-layer policy sat at a guess, then found the match at
#      once, ~1500 steps of 256; the shipped 2-layer one did not find it here);
#   2. every input the policy reads rendered at 128 tokens, the instruction still drawn (the
#      shipped policy found the match here, at ~700 of 800 steps);
#   3. the whole mix (every budget, half the instructions drawn, a tenth lookup contexts, a
#      quarter the contexts a full meaning cache holds) with one DAgger round driven at 256
#      tokens, from stage 2; of its two rounds, the one that reaches more goals over 16
#      validation episodes at 256 tokens is exported.
# The shipped checkpoint (128 wide, 2 layers, no /odom, 0.66M parameters, small enough for a
# 10x faster-than-real-time offline replay on 2 CPU cores) is this script's output,
# unchanged: one run on the H200, 362 s, beside a second candidate (160 wide, one key/value
# head, which never found the lookup) on the same host, with WORKERS=8 each
# (rt_llm_node/demo/model/training.json, "retrain" and "stages"). Stage 3 is bounded by
# steps (1500 a round), not by time: a 3.1-minute bound gave 1148 + 868 steps on a slower
# H200 host. Its meaning contexts with stale observations (--meaning-share,
# --stale-ticks) are what keeps the success at 256 tokens, where the demo runs: without them
# retrains kept 81-89% of their full-cache success there, with them 103-105%.
#
#   training/recipe.sh OUT [DEVICE [STAGES]]
#     DEVICE: cuda (default) or cpu; STAGES: keep the stage-1 and stage-2 checkpoints there
#   Environment (defaults: the shipped policy's): SHAPE, lookup_stage --shape items of the
#   fresh stage-1 model, space-separated (e.g. "hidden_size=128 num_hidden_layers=2
#   num_attention_heads=4"); INPUTS, the topics stages 2 and 3 render; WORKERS, stage 3's
#   episode processes.
#
# Offline tooling (torch, transformers); on the GPU machine:
#   OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 training/recipe.sh $OUT/model cuda /tmp/stages
set -euo pipefail
out=${1:?usage: training/recipe.sh OUT [cuda|cpu]}
device=${2:-cuda}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"   # the package, from any cwd
if [ -n "${3:-}" ]; then
    mkdir -p "$3"
    stages=$(cd "$3" && pwd)
else
    stages=$(mktemp -d)
    trap 'rm -rf "$stages"' EXIT
fi
SHAPE=${SHAPE-hidden_size=128 num_hidden_layers=2 num_attention_heads=4}
INPUTS=${INPUTS:-/instruction,/scan,/detections}
WORKERS=${WORKERS:-16}
shape_args=()
for item in $SHAPE; do shape_args+=(--shape "$item"); done
SECONDS=0
cd "$here"   # lookup_stage imports train from beside it
python3 -u lookup_stage.py --counterfactual 1 --topics /instruction,/detections --budget 48 \
    --steps 1750 --every 250 --batch 256 --episodes 40 --device "$device" --save "$stages/s1" \
    ${shape_args[@]+"${shape_args[@]}"}
python3 -u lookup_stage.py --model "$stages/s1" --counterfactual 1 \
    --topics "$INPUTS" --budget 128 --steps 800 --every 100 \
    --batch 128 --episodes 40 --device "$device" --save "$stages/s2"
echo "stages 1-2: ${SECONDS} s"
cd - > /dev/null
python3 -u "$here/train.py" --init "$stages/s2" --out "$out" --episodes 640 \
    --steps 1500 --batch 128 --lr 1e-3 --dagger-rounds 1 --dagger-episodes 64 --aim \
    --counterfactual 0.5 --lookup-share 0.1 --meaning-share 0.25 --stale-ticks 8 \
    --dagger-capacity 256 \
    --select-episodes 16 --select-capacity 256 --max-minutes 4.5 --workers "$WORKERS"
echo "retrain: ${SECONDS} s"

