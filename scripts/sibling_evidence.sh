#!/usr/bin/env bash
# Issue 29's long runs in their order, each resumable (a step already done costs only its checks), so one command
# continues them in any session, on any machine of this kind:
#
#     nohup setsid bash scripts/sibling_evidence.sh > runs/sibling-evidence.log 2>&1 &
#
# Needs the sibling fixtures (python -m peft_kvcache.modeling.fixtures gguf:qwen2.5-coder-0.5b-instruct
# gguf:qwen2.5-coder-1.5b-instruct). Lever maps live in runs/levers (not in git): fitted again where missing, to the
# same bytes on the same CPU arithmetic (records keep their rows). Records append to benchmarks/results/sibling-recipes
# and must be committed before a session ends. Every run is passed every lever fitted so far (`levers`): a final run
# needs the maps of whatever default the selection records chose, a lever fitted later included.
set -euo pipefail
cd "$(dirname "$0")/.."
base=runs/levers/capture-top2
pairs="qwen2.5-coder-0.5b-to-1.5b-top2 qwen2.5-coder-1.5b-to-0.5b-top2"
for pair in $pairs; do  # the capture's top-2 fit, in git
    if [ ! -f "$base/$pair/model.safetensors" ]; then
        mkdir -p "$base/$pair"
        for f in config.json model.safetensors; do git show "009d39d:hub_cards/$pair/$f" > "$base/$pair/$f"; done
    fi
done
lever() { python -m benchmarks.lever_maps "$@"; }
recipes() { python -m benchmarks.recipes "$@"; }
# every lever's maps fitted so far (both pairs' weights): a final run needs whichever maps the selection records
# chose, including levers fitted after the step that runs it (a step is run again in every later session)
levers() {
    for folder in runs/levers/*/; do
        folder=${folder%/}
        [ "$folder" != "$base" ] || continue
        for pair in $pairs; do [ -f "$folder/$pair/model.safetensors" ] || continue 2; done
        printf -- '--lever %s=%s ' "$(basename "$folder")" "$folder"
    done
}
# the selection rows of every lever fitted so far (the report waits, refusing, while any lever is scored on fewer
# examples than planned, a lever fitted by a later step included), the selection report, then the final 2k texts of
# the default it chose (only that default's rows are missing there)
selected() {
    recipes run --maps $base $(levers) --role selection --context 2048 --passes-limit 52
    recipes report --role selection --context 2048
    recipes run --maps $base $(levers) --role final --context 2048 --passes-limit 52
    recipes report --role final --context 2048
}
lever --label top4 --top-k 4
lever --label basis512 --top-k 28 --basis-rank 512
selected  # each selection report is followed by the final 2k texts of whatever default it chose
lever --label joint --joint-kinds
# the attention bonus (peft_kvcache.calibration.bonus) on both defaults' maps: 1 nat, from a probe on selection texts
lever --label top4-bonus1 --bonus 1 --on top4
lever --label basis512-bonus1 --bonus 1 --on basis512
selected
# the bonus's size: 2 nats on both defaults' maps (the target's query moments are read once per direction and kept;
# the probe on selection windows found 2 nats better than 1 going down)
lever --label top4-bonus2 --bonus 2 --on top4
lever --label basis512-bonus2 --bonus 2 --on basis512
selected
# the final 4k texts of the defaults chosen so far, before the levers that need captures of their own (hours each):
# a default a later lever wins adds only its own rows here
recipes run --maps $base $(levers) --role final --context 4096 --passes-limit 52
recipes report --role final --context 4096
# attention weighting (CacheBridge): alone on the capture's top-2 choice, and on each direction's default maps from the
# same statistics (the top-k and the shared basis are fitted from them; the bonus from the kept query moments)
lever --label attention --attention-weighting 0.5
lever --label attention-basis512 --attention-weighting 0.5 --top-k 28 --basis-rank 512
lever --label attention-top4 --attention-weighting 0.5 --top-k 4
lever --label attention-top4-bonus1 --bonus 1 --on attention-top4
selected
# distillation alone, on the capture's fit (hours: the target's backward passes); on the defaults' maps only if it pays
lever --label distill --distill --on capture-top2
selected
lever --label l2048 --max-length 2048
selected
lever --label nonlinear --nonlinear --on top4
selected
recipes run --maps $base $(levers) --role final --context 4096 --passes-limit 52
recipes report --role final --context 4096
