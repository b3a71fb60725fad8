#!/usr/bin/env bash
# The GPU benchmark suites behind the figures of README.md and docs/performance.md, one command each, each within
# 10 minutes on one H200 (`layouts` and `scaling`: 2 GPUs of one host). Results go to $OUT (default /tmp/gpu_out):
# JSON tables (the rows of benchmarks/results/*.json), logs and the test report lines.
#
#   bash scripts/bench_suites.sh megadlms [bf16|fp8|s2048]  # difflm's fastest 1.7B rows against MegaDLMs, same job
#                                                          # (needs .megadlms: scripts/megadlms_baseline.py export)
#   bash scripts/bench_suites.sh trainer                  # difflm-train at the 1.7B BF16 row's shape: median tokens/s
#   bash scripts/bench_suites.sh small                    # model=125m (S=1024) and model=350m (S=2048), BF16 and FP8
#   bash scripts/bench_suites.sh moe                      # moe-1b-7b against dense-1b (its active size), BF16 / FP8
#   bash scripts/bench_suites.sh moe megadlms             # moe-1b-7b TE BF16 against MegaDLMs' Megatron-Core MoE, same
#                                                          # job and shape (needs .megadlms; both need an H200)
#   bash scripts/bench_suites.sh moe kernels              # the MoE kernel switches at micro-batch 2: the Triton combine
#                                                          # against the batched GEMM, quack's tuned expert tiles
#   bash scripts/bench_suites.sh layouts                  # 2 GPUs: ddp fsdp tp2 pp2 cp2 x (te, torch) against one GPU
#   bash scripts/bench_suites.sh scaling                  # 2 GPUs: weak scaling, DP levers, tp2, 8b under fsdp
#   bash scripts/bench_suites.sh adaptation CORPUS [RECIPES] # AR-to-diffusion recipes at model=125m: adapted vs scratch
#   bash scripts/bench_suites.sh sampling RUN_DIR         # Fast-dLLM decoding (threshold, KV caches) against LLaDA's
#   bash scripts/bench_suites.sh kernels                  # attention, QKV, MLP half block, FA4 tiles, optimizer alone
#   bash scripts/bench_suites.sh profile                  # the 1.7B BF16 row profiled (kernel classes, busy share)
#   bash scripts/bench_suites.sh gputests                 # every test file with CUDA tests (junit in $OUT)
#
# The environment (optional kernels staged under $SITE, cuDNN, NVLink multicast off, quack's cache) comes from
# scripts/gpu_env.sh. The fastest rows use model.backend=te model.attention_backend=flash model.fused_mlp=true
# model.fused_mlp_autotune=true at micro-batch 8 (BF16) and TE FP8 with FP8 attention at micro-batch 8 (FP8).
#
# Usage errors (no suite, an unknown one, a bad or extra suite argument, not started from the checkout's root) and a
# machine that cannot run the suite (python3 or timeout not on PATH, no CUDA GPU, no .megadlms export for the MegaDLMs
# suites) are one line on stderr, exit status 2, before anything is set up. Every command of the suite runs even when
# an earlier one fails; the exit status is then 1, after one line naming the suite and $OUT. -h / --help prints this
# text.
set -u
SUITES="megadlms|trainer|small|moe|layouts|scaling|adaptation|sampling|kernels|profile|gputests"
usage() {
  echo "bench_suites.sh: error: $* (usage: bash scripts/bench_suites.sh $SUITES [ARGS];" \
    "--help lists each suite's ARGS)" >&2
  exit 2
}
refuse() { echo "bench_suites.sh: error: $*" >&2; exit 2; }  # a machine or folder that cannot run the suite
help() { sed -n '2,/^set -u$/p' "$0" | sed -e '/^set -u$/d' -e 's/^# \{0,1\}//' -e 's/^#$//'; }
for arg in "$@"; do
  case "$arg" in -h|--help) help; exit 0 ;; esac
done
[ $# -ge 1 ] || usage "name a suite"
suite=$1
shift
case "|$SUITES|" in *"|$suite|"*) ;; *) usage "unknown suite '$suite'" ;; esac
case "$suite" in
  megadlms) case "${1:-bf16}" in bf16|fp8|s2048) ;; *) usage "megadlms takes bf16, fp8 or s2048, not '$1'" ;; esac ;;
  moe) case "${1:-}" in ""|megadlms|kernels) ;; *) usage "moe takes nothing, megadlms or kernels, not '$1'" ;; esac ;;
  adaptation) [ $# -ge 1 ] || usage "adaptation needs CORPUS (a text folder, e.g. the Gutenberg novels) [RECIPES]" ;;
  sampling) [ $# -ge 1 ] || usage "sampling needs RUN_DIR (a trained run, e.g. from make train)" ;;
esac
case "$suite" in
  megadlms|moe) most=1 what="at most one argument" ;; sampling) most=1 what="one argument" ;;
  adaptation) most=2 what="at most two arguments" ;; *) most=0 what="no arguments" ;;
esac
[ $# -le $most ] || usage "$suite takes $what, not $# ($*)"
case "$0" in */*) here=${0%/*} ;; *) here=. ;; esac
[ -f scripts/bench_suites.sh ] && [ -d difflm ] || refuse "run it from the root of the difflm checkout" \
  "(cd $here/..), not from $PWD"
for tool in python3 timeout; do
  command -v $tool > /dev/null || refuse "$tool is not on PATH; the suites need it"
done
cuda=$(python3 -c "import torch; print(torch.cuda.is_available())" 2>&1 | tail -1)
case "$cuda" in
  True) ;;
  False) refuse "$suite needs a CUDA GPU (torch.cuda.is_available() is False)" ;;
  *) refuse "python3 cannot import torch ($cuda): put the Python that difflm is installed in first on PATH" ;;
esac
if [ "$suite" = megadlms ] || [ "${1:-}" = megadlms ]; then
  [ -f .megadlms/pretrain_difflm.py ] && [ -d .megadlms/megatron ] || refuse "no MegaDLMs export in .megadlms" \
    "(pretrain_difflm.py, megatron/): make one with python scripts/megadlms_baseline.py export --git-dir <mirror>" \
    "--out .megadlms"
fi
args=("$@")
set --  # gpu_env.sh reads its own arguments: give it none
. scripts/gpu_env.sh
set -- ${args[@]+"${args[@]}"}
# from here on a failing command (a pipeline too: its first failing part) makes the exit status 1; the suite goes on
status=0
trap 'status=1' ERR
set -E -o pipefail

T="model.backend=te model.attention_backend=te"       # Transformer Engine, cuDNN attention
F="model.backend=te model.attention_backend=flash"    # Transformer Engine, FlashAttention 4
FM="model.fused_mlp=true model.fused_mlp_autotune=true"
MB8="train.micro_batch_size=8"
S2="data.seq_len=2048 train.global_batch_size=32"      # model=1.7b at S=2048 (MegaDLMs' second shape)
M350="model=350m data.seq_len=2048 train.global_batch_size=32 train.micro_batch_size=16"
BF16_ROW="te-bf16-flash-mb8-fused: $F $MB8 $FM"
FP8_ROW="te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8"
S2_BF16_ROW="te-bf16-flash-s2048-mb16-fused: $F $S2 train.micro_batch_size=16 $FM"
S2_FP8_ROW="te-fp8-s2048-mb8: $T precision=fp8 $S2 $MB8"
ROW_1P7B="model=1.7b data.seq_len=4096 train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate
  --steps 6 --warmup 3 --batches 2"

# model=1.7b rows against MegaDLMs at SHAPES in one job: bench_vs_megadlms SHAPES PRECISIONS VARIANT...
bench_vs_megadlms() {
  local shapes=$1 precisions=$2; shift 2
  local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  local budget=${BENCH_BUDGET:-560}
  CUDA_VISIBLE_DEVICES=0 timeout $((budget + 10)) python3 scripts/benchmark.py $ROW_1P7B train.micro_batch_size=4 \
    --row-timeout "${ROW_TIMEOUT:-400}" --time-budget "$budget" --json "$OUT/bench.json" \
    --megadlms .megadlms --megadlms-shapes "$shapes" --megadlms-precisions "$precisions" \
    --megadlms-timeout 150 "${variants[@]}" > "$OUT/bench.log" 2>&1
  tail -20 "$OUT/bench.log"
}
# rows at a small model's shape within BUDGET s: bench_small BUDGET JSON VARIANT...
bench_small() {
  local budget=$1 json=$2; shift 2
  local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  CUDA_VISIBLE_DEVICES=0 timeout $((budget + 10)) python3 scripts/benchmark.py model=125m data.seq_len=1024 \
    train.micro_batch_size=64 train.global_batch_size=64 precision=bf16 device=cuda --no-reference --isolate \
    --steps 8 --warmup 3 --batches 2 --row-timeout 120 --time-budget "$budget" --json "$OUT/$json" \
    "${variants[@]}" 2>&1 | tail -30
}

case "$suite" in
megadlms)
  case "${1:-bf16}" in
    bf16) bench_vs_megadlms 4096x16 bf16 "$BF16_ROW" ;;
    fp8) bench_vs_megadlms 4096x16 fp8 "$FP8_ROW" ;;
    s2048) bench_vs_megadlms 2048x32 bf16,fp8 "$S2_BF16_ROW" "$S2_FP8_ROW" ;;
    *) usage "megadlms takes bf16, fp8 or s2048, not '$1'" ;;
  esac
  # QUACK_CACHE_ARCHIVE of scripts/gpu_env.sh (none without quack's cache)
  [ ! -d "$QUACK_CACHE_DIR" ] || tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" .
  ;;
trainer)
  rm -rf /tmp/trainer && CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m difflm.train model=1.7b $F $FM precision=bf16 \
    data.seq_len=4096 $MB8 train.global_batch_size=16 device=cuda train.max_steps=22 train.eval_every=0 \
    train.save_every=0 logger.log_every=1 logger.progress_bar=false logger.num_samples=0 \
    objective.random_length_prob=0 run.dir=/tmp/trainer > "$OUT/trainer.log" 2>&1
  tail -2 "$OUT/trainer.log"
  python3 -c "import json,statistics as st; r=[json.loads(l) for l in open('/tmp/trainer/metrics.jsonl')]; \
r=[x for x in r if 'tokens_per_s' in x and x['step'] > 5]; print('trainer tokens/s median', \
st.median(x['tokens_per_s'] for x in r), 'mfu', st.median(x.get('mfu') or 0 for x in r))"
  ;;
small)
  bench_small 560 bench_small.json "125m-flash-bf16-mb64: $F" "125m-te-fp8-mb64: $T precision=fp8" \
    "350m-flash-bf16-mb16: $F $M350" "350m-flash-fp8-mb16: $F precision=fp8 $M350"
  ;;
moe)
  export CUDA_VISIBLE_DEVICES=0
  if [ "${1:-}" = megadlms ]; then
    # model=moe-1b-7b at the rows' shape below; MegaDLMs' row follows the base model=: Megatron-Core's MoE with the
    # preset's routing (scripts/megadlms_baseline.py moe_flags), MFU over the active parameters on both sides.
    # ~104 GiB each (6.9B parameters, FP32 master weights and AdamW state): one H200.
    timeout 570 python3 scripts/benchmark.py model=moe-1b-7b data.seq_len=4096 train.micro_batch_size=1 \
      train.global_batch_size=8 precision=bf16 device=cuda --no-reference --isolate --steps 5 --warmup 2 --batches 2 \
      --row-timeout 240 --time-budget 555 --json "$OUT/bench_moe_megadlms.json" \
      --megadlms .megadlms --megadlms-precisions bf16 --megadlms-timeout 270 \
      --variant "moe-1b-7b-te-bf16: $T" --variant "moe-1b-7b-te-bf16-grouped: $T model.moe.fused_experts=false" \
      > "$OUT/bench_moe_megadlms.log" 2>&1
    tail -20 "$OUT/bench_moe_megadlms.log"
  elif [ "${1:-}" = kernels ]; then
    timeout 150 python3 -m pytest tests/test_token_permutation.py tests/test_moe.py -q -p no:cacheprovider -rf \
      -p no:warnings --tb=line -k "cuda or interpreter" 2>&1 | tail -8
    timeout 60 python3 scripts/moe_permutation_speed.py --json "$OUT/moe_permutation.json" 2>&1 | tail -8
    # the combine rows twice each, so the run-to-run spread of the last loss is beside the kernels' difference; the
    # tuned row last (quack tunes each expert GEMM shape once; its disk cache keeps the tiles for the machine)
    timeout 400 python3 scripts/benchmark.py model=moe-1b-7b data.seq_len=4096 train.micro_batch_size=2 \
      train.global_batch_size=8 precision=bf16 device=cuda --no-reference --isolate --steps 5 --warmup 2 --batches 2 \
      --row-timeout 200 --time-budget 390 --json "$OUT/bench_moe_kernels.json" \
      --variant "moe-1b-7b-te-bf16-mb2: $T" \
      --variant "moe-1b-7b-te-bf16-mb2-bmm-combine: $T model.moe.fused_combine=false" \
      --variant "moe-1b-7b-te-bf16-mb2-again: $T" \
      --variant "moe-1b-7b-te-bf16-mb2-bmm-combine-again: $T model.moe.fused_combine=false" \
      --variant "moe-1b-7b-te-bf16-mb2-tuned: $T model.fused_mlp_autotune=true" 2>&1 | tail -14
  else
    timeout 60 python3 -m pytest tests/test_moe.py -q -p no:cacheprovider -rs -k cuda 2>&1 | tail -6
    # 8 micro-batches per optimizer step, as a training run accumulates: the AdamW update of moe-1b-7b's 6.9B FP32
    # parameters is paid once per 8 sequences, not once per sequence
    timeout 520 python3 scripts/benchmark.py data.seq_len=4096 train.micro_batch_size=1 train.global_batch_size=8 \
      precision=bf16 device=cuda --no-reference --isolate --steps 5 --warmup 2 --batches 2 --row-timeout 130 \
      --time-budget 510 --json "$OUT/bench_moe.json" \
      --profile moe-1b-7b-te-bf16 --profile-rows 25 \
      --variant "moe-1b-7b-te-bf16: model=moe-1b-7b $T" --variant "dense-1b-te-bf16: model=dense-1b $T" \
      --variant "moe-1b-7b-te-bf16-grouped: model=moe-1b-7b $T model.moe.fused_experts=false" \
      --variant "moe-1b-7b-te-bf16-mb2: model=moe-1b-7b $T train.micro_batch_size=2" \
      --variant "moe-1b-7b-te-fp8: model=moe-1b-7b $T precision=fp8" \
      --variant "dense-1b-te-fp8: model=dense-1b $T precision=fp8" 2>&1 | tail -30
  fi
  ;;
layouts)
  timeout 400 python3 scripts/layout_check.py --gpus 2 --parts correctness,reshard --out "$OUT/lc" --time-budget 390 \
    --timeout 110 --steps 4 --backends te,torch --layouts ddp,fsdp,tp2,pp2,cp2 \
    -- model=125m precision=bf16 data.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=16 2>&1 | tail -30
  for layout in ep2 fsdp; do
    timeout 90 python3 scripts/layout_check.py --gpus 2 --parts big --big-model moe-1b-7b --big-layout $layout \
      --big-backends torch --precisions bf16 --out "$OUT/moe_$layout" --timeout 85 \
      -- data.seq_len=4096 train.micro_batch_size=1 2>&1 | tail -6
  done
  ;;
scaling)
  timeout 580 python3 scripts/layout_check.py --gpus 2 --parts throughput,big --out "$OUT/scale" --time-budget 560 \
    --timeout 170 --tput-backends te --precisions bf16,fp8 --tput-model 1.7b --tput-seq 4096 --tput-micro 4 \
    --tput-accum 4 --tput-steps 8 --warmup 3 --dp-layout ddp --tp-layouts bf16@tp2 \
    --tput-variants ddp:parallel.reduce_dtype=bf16,tp2:parallel.tp_comm_overlap=true \
    --big-model 8b --big-layout fsdp --big-micro 1 --big-precisions bf16 2>&1 | tail -40
  ;;
adaptation)
  # a 400-step AR checkpoint, then each recipe 150 steps adapted and from scratch (docs/adaptation.md); ~3 min per
  # recipe on an H100, so one or two recipes per 10-minute job. The AR checkpoint stays in ADAPT_OUT (default
  # /root/adaptation) and later jobs on the same machine adapt it without training it again.
  corpus=${1:?usage: bench_suites.sh adaptation CORPUS (a text folder, e.g. the Gutenberg novels) [RECIPES]}
  CUDA_VISIBLE_DEVICES=0 timeout 575 python3 scripts/adaptation_table.py --ar-steps 400 --adapt-steps 150 \
    --eval-every 50 --target-nelbo scratch --recipes "${2:-fast_dllm_v2,megatron_bridge_hybrid}" \
    --out "${ADAPT_OUT:-/root/adaptation}" \
    --json "$OUT/adaptation_125m.json" -- model=125m data.path="$corpus" data.seq_len=1024 device=cuda precision=bf16 \
    model.backend=torch model.attention_backend=sdpa model.fused_cross_entropy=false model.fused_qkv=false \
    train.global_batch_size=64 train.micro_batch_size=16 optim.lr=6e-4 train.eval_windows=128 \
    train.eval_mc_samples=2 2>&1 | grep -v Warning | tail -20
  ;;
sampling)
  run_dir=${1:?usage: bench_suites.sh sampling RUN_DIR (a trained run, e.g. from make train)}
  CUDA_VISIBLE_DEVICES=0 timeout 500 python3 scripts/fast_sampling_speedup.py "$run_dir" --length 256 --block 32 \
    --batch 8 2>&1 | tail -20
  ;;
kernels)
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python3 scripts/attention_speed.py --shape 1.7b-s4096=8,4096,16,128 --shape 125m-s1024=64,1024,12,64 \
    --backend te --backend sdpa --backend flash --gemm-between 8 --json "$OUT/attention.json" 2>&1 | tail -12
  timeout 100 python3 scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --shape 125m-mb64=64,1024,12,12,64 \
    --json "$OUT/qkv_speed.json" 2>&1 | tail -12
  timeout 150 python3 scripts/mlp_speed.py --shape 1.7b-mb8=32768,2048,6144 --json "$OUT/mlp.json" 2>&1 | tail -4
  timeout 100 python3 scripts/flash_tiles.py --shape 8,4096,16,128 --gemm-between 8 --iters 10 \
    --only bwd-default --only fwd-default --json "$OUT/tiles.json" 2>&1 | tail -4
  timeout 60 python3 scripts/optimizer_speed.py model=1.7b 2>&1 | tail -6
  ;;
profile)
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/benchmark.py $ROW_1P7B $MB8 --row-timeout 290 \
    --json "$OUT/bench_profile.json" --profile prof --profile-rows 30 --variant "prof: $F $FM" \
    > "$OUT/bench_profile.log" 2>&1
  grep -A3 "^row " "$OUT/bench_profile.log" | tail -1; grep -m1 -A39 "Class " "$OUT/bench_profile.log"
  # the trainer's own steps traced (profile.*), and the GPU's idle gaps in that trace with the host work during them
  rm -rf /tmp/trainer_prof && CUDA_VISIBLE_DEVICES=0 timeout 250 python3 -m difflm.train model=1.7b $F $FM \
    precision=bf16 data.seq_len=4096 $MB8 train.global_batch_size=16 device=cuda train.max_steps=12 \
    train.eval_every=0 train.save_every=0 logger.num_samples=0 logger.progress_bar=false \
    profile.enabled=true profile.wait=6 profile.warmup=2 profile.active=2 run.dir=/tmp/trainer_prof \
    > "$OUT/trainer_prof.log" 2>&1
  for f in /tmp/trainer_prof/profile/*.json*; do [ -f "$f" ] && python3 scripts/trace_gaps.py "$f" --top 10; done
  ;;
gputests)
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  files=$(ls tests/test_{allocator,cross_entropy,cuda_graphs,embedding,lora_te_cuda,loss_rows,moe,qkv,quack_mlp,\
sdpa_priority,step_syncs,te_backend,token_permutation}.py)
  timeout "${TESTS_BUDGET:-560}" python3 -m pytest ${FILES:-$files} -q -p no:cacheprovider -rfs \
    -k "${ONLY:-not interpreter}" --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
  ;;
*) usage "unknown suite '$suite'" ;;
esac
[ $status -eq 0 ] || echo "bench_suites.sh: $suite: a command failed (its output is above; logs in $OUT)" >&2
exit $status
