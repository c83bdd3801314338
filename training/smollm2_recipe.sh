#!/usr/bin/env bash
# The shipped SmolLM2 adapter's recipe (rt_llm_node/demo/smollm2/): bags of the demo's expert
# driving, recorded with its commands, then a LoRA fine-tune of SmolLM2-135M-Instruct on what
# the node would have fed the model at each recorded tick (training/finetune.py).
#
#   training/smollm2_recipe.sh BASE_GGUF OUT [WORKERS]
#
# Bags: 8 x 240 s on training seeds (0, 1000, ... 7000; the evaluation's held-out seeds start
# at 1000000); every second one with noise on what the robot executes (not on the recorded
# command), so the data holds the expert's answer in states its own drive would not reach.
# One more of 60 s (seed 900000) is never trained on: the share of its actions the adapter
# gets exactly right is printed every 200 steps and kept in training.json.
# BAGS=DIR: use (or keep) the bags there. The samples are built without the base model's
# attention (--attention none): exact for the instruction, the newest inputs and the
# superseded ones the meaning policy drops first, with older segments dropped by age where
# the node would drop the least attended; running the base beside every recorded tick costs
# more GPU time than the training itself (a ~125-token prefill a tick). The actions the
# context shows of earlier ticks carry noise (--history-noise, labels clean): trained on the
# clean history, the adapter learns to repeat its last action and, in closed loop, repeats a
# wrong first one for ever (bag_samples.py). --history-hold shows a random action held for
# up to a second and --restart-every empties the cache as a restart would, so the adapter
# also learns to decide from the observations with a wrong history or none.
# Offline tooling (torch, transformers, peft); on the GPU machine.
set -euo pipefail
base=${1:?usage: training/smollm2_recipe.sh BASE_GGUF OUT [WORKERS]}
out=${2:?usage: training/smollm2_recipe.sh BASE_GGUF OUT [WORKERS]}
workers=${WORKERS:-${3:-8}}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${BAGS:-}" ]; then
    bags=$BAGS
    mkdir -p "$bags"
else
    bags=$(mktemp -d)
    trap 'rm -rf "$bags"' EXIT
fi
SECONDS=0
for i in 0 1 2 3 4 5 6 7; do
    [ -f "$bags/b$i/metadata.yaml" ] && continue
    noise=0,0
    if [ $((i % 2)) = 1 ]; then noise=0.15,0.5; fi
    python3 -m rt_llm_node.demo.recorder "$bags/b$i" --seconds 240 --seed $((i * 1000)) \
        --commands --noise "$noise" > /dev/null &
done
if [ ! -f "$bags/holdout/metadata.yaml" ]; then
    python3 -m rt_llm_node.demo.recorder "$bags/holdout" --seconds 60 --seed 900000 \
        --commands > /dev/null &
fi
wait
echo "bags: ${SECONDS} s"
python3 -u "$here/finetune.py" --params "$(dirname "$here")/config/demo_smollm2.yaml" \
    --base "$base" --bags "$bags"/b* --out "$out" --workers "$workers" --attention none \
    --steps 1600 --batch 32 --lr 1e-3 --rank 8 --alpha 16 --history-noise 0.2,0.6 \
    --history-hold 0.03 --restart-every 10 --holdout "$bags/holdout" --eval-every 200 \
    ${MAX_MINUTES:+--max-minutes "$MAX_MINUTES"}
echo "recipe: ${SECONDS} s"
