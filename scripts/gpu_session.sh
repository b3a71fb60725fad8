#!/usr/bin/env bash
# The GPU runs behind the figures of README.md and docs/*.md, as one-call parts of at most 10 minutes each on a
# 2 x H200 machine (Transformer Engine 2.20 and flash-attn 4 staged into /root/site: docs/performance.md says how).
#
#   bash scripts/gpu_session.sh single   # GPU 0: benchmark vs MegaDLMs (mdlm, bd3lm, flash rows; .megadlms carried)
#                                        # GPU 1: the CUDA tests (TE parity incl. bd3lm and packed documents, FP8,
#                                        #        attention backends, one sync per step), MoE vs dense rows, the
#                                        #        small-model rows of issue 17
#   bash scripts/gpu_session.sh layouts  # 2 GPUs: ddp fsdp tp2 pp2 cp2 x (te, torch) against one GPU, MoE ep2 / fsdp
#   bash scripts/gpu_session.sh scale    # 2 GPUs: weak scaling, DP levers, tp2 (+ comm overlap), 8b under fsdp
#   bash scripts/gpu_session.sh speed    # 2 GPUs: issue 17's levers against MegaDLMs, their tests, small models,
#                                        #         a profile and the trainer's tokens/s
#   bash scripts/gpu_session.sh profile  # 1 GPU: MoE kernel tests, MoE vs dense rows (profiled), and model=1.7b
#                                        #        TE BF16 / FP8 against MegaDLMs at S=4096, both profiled
#   bash scripts/gpu_session.sh speed2|speed3|speed4|speed5|speed6|speed7
#                                        # 2 GPUs: issue 17's later calls (repeats, FA4, the fused cross-entropy,
#                                        #         micro-batch 8 at S=2048, small models at larger micro-batches;
#                                        #         speed7: the comparison again, with sdpa on GPU 1)
#   bash scripts/gpu_session.sh sdpa     # 1 GPU: the SDPA kernel order tested and timed, torch kernels at 125m / 350m
#   bash scripts/gpu_session.sh fp8small # 1 GPU: FP8 at 125m / 350m, the trainer at 1.7B FP8 S=2048, torch kernels
#   bash scripts/gpu_session.sh fp8flash # 1 GPU: FP8 + FA4 at 125m / 350m, allocator tests, the trainer again
#   bash scripts/gpu_session.sh graphs   # 1 GPU: CUDA graphs of the TE blocks tested and timed at 1.7B, the trainer
#   bash scripts/gpu_session.sh speed8|smallgraphs
#                                        # 1 GPU: the comparison with graphed FP8 rows; the small models graphed
#   bash scripts/gpu_session.sh speed9   # 1 GPU: the graphs tests again, micro-batch 8 at S=4096 (FP8, BF16), profiled
#   bash scripts/gpu_session.sh speed10|mb8fair|mb8profile
#                                        # 1 GPU: the comparison with micro-batch 8 rows; MegaDLMs at micro-batch 8
#                                        #        and the trainer; the BF16 micro-batch 8 rows profiled and repeated
#   bash scripts/gpu_session.sh qkvtriton  # 1 GPU: the Triton QKV kernels tested and timed against torch.compile,
#                                        #        the micro-batch 8 rows with them (BF16 profiled)
#   bash scripts/gpu_session.sh qkvtriton2|speed11
#                                        # 1 GPU: the backward kernel on (row tile, KV group) programs tested and timed,
#                                        #        the trainer beside its benchmark row; the comparison against MegaDLMs
#   bash scripts/gpu_session.sh fusedmlp|speed12|trainfused
#                                        # 1 GPU: the fused MLP half block (quack) tested, timed alone and in the
#                                        #        1.7B BF16 rows; the comparison with it; the trainer with it
#   bash scripts/gpu_session.sh settle   # 1 GPU: the trainer reading each step's outcome a step late, beside its
#                                        #        benchmark row (profiled) and the trainer of an earlier commit;
#   bash scripts/gpu_session.sh speed13|speed14  # speed13: the BF16 comparison again, S=2048 also at micro-batch 16;
#                                        #        speed14: every 1.7B target against MegaDLMs in one call
#   bash scripts/gpu_session.sh quackqkv|speed15  # the attention half's norm + QKV on quack and the clip inside
#                                        #        the fused AdamW: tests, the row before/after; then against MegaDLMs
#   bash scripts/gpu_session.sh projcast|speed16  # casts once a step: tests, the row (profiled); then the
#                                        #        in-place weight gradients tested, MegaDLMs BF16 S=4096 beside the
#                                        #        rows of this and the commit before, and the trainer;
#                                        #        projab: this tree against .device-stage/old, row for row
#   bash scripts/gpu_session.sh qkvflash|speed17  # QKV heads + FA4 as one function (v in place): tests, the row
#                                        #        against .device-stage/old (profiled); then against MegaDLMs, trainer
#   bash scripts/gpu_session.sh flashtiles|speed18|recheck  # FA4's SM90 tiles swept (scripts/flash_tiles.py);
#                                        #        MegaDLMs BF16 beside this tree and .device-stage/old; the FP8,
#                                        #        350m and 125m targets again (SMALL=1 / SMALL=bf16)
#   bash scripts/gpu_session.sh qkvbwd|qkvbwd2  # the QKV backward's tiles per program, half the RoPE tables read:
#                                        #        CUDA tests, settings timed in place, this tree vs old (profiled),
#                                        #        MegaDLMs BF16 beside it
#   bash scripts/gpu_session.sh levers36  # FA4's forward tile, QKV backward programs of 32 tiles, the loss's gradient
#                                        #        written into the logits, the embedding's into main_grad: CUDA tests,
#                                        #        MegaDLMs beside this tree's row, the old tree's row
#   STEP=1|2|3 bash scripts/gpu_session.sh final17  # MegaDLMs BF16 and this tree's 1.7B BF16 row alternating over
#                                        #        calls on one machine, the row profiled, the trainer beside it
#   bash scripts/gpu_session.sh gputests  # every file's CUDA tests (junit + report lines in $OUT); OLD_K=<pytest -k>
#                                        #        runs those on .device-stage/old too, to tell new faults from old
#   bash scripts/gpu_session.sh checks  # the BF16 S=4096 step's kernel classes listed, the timing scripts, CUDA tests
#   bash scripts/gpu_session.sh trainer_gaps|trainer125|attn
#                                        # 2 GPUs: the trainer at 125m traced (scripts/trace_gaps.py) / timed,
#                                        #         beside the benchmark row; attn: attention in isolation
#                                        #         (scripts/attention_speed.py), cuDNN norms, a 350m profile
#
# Results go to $OUT (default /tmp/gpu_out): JSON tables, logs and DIFFLM_TEST_REPORT lines.
set -u
part=${1:?usage: gpu_session.sh single|layouts|scale|profile|speed|speed2..speed7|trainer_gaps|trainer125|attn|sdpa|fp8small|fp8flash|graphs|speed8|smallgraphs|speed9|speed10|mb8fair|mb8profile|qkvtriton|qkvtriton2|speed11|fusedmlp|speed12|trainfused|settle|speed13|speed14|quackqkv|speed15|projcast|speed16|projab|qkvflash|speed17|flashtiles|speed18|recheck|checks|lossrows|speed19|qkvbwd|qkvbwd2|levers36|gputests|final17}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
SITE=${SITE:-/root/site}  # quack fingerprints its kernels by path: code under a "site-packages" directory is library code
export PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1
CUDNN_HOME=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2>/dev/null) && \
  export CUDNN_HOME LD_LIBRARY_PATH=$CUDNN_HOME/lib:${LD_LIBRARY_PATH:-}  # TE must load PyTorch's cuDNN
T="model.backend=te model.attention_backend=te"
F="model.backend=te model.attention_backend=flash"  # TE with FlashAttention 4
S2="data.seq_len=2048 train.global_batch_size=32"    # model=1.7b at S=2048 (MegaDLMs' second shape)
M350_16="model=350m data.seq_len=2048 train.global_batch_size=32 train.micro_batch_size=16"
MB8="train.micro_batch_size=8"                                   # model=1.7b's micro-batch since session 24
FM="model.fused_mlp=true model.fused_mlp_autotune=true"          # quack's MLP half block and QKV input, tuned tiles

# model=1.7b, S=4096, micro-batch 4 x 4 against MegaDLMs (shapes "$1") on GPU 0, one 575 s call: bench_vs_megadlms SHAPES VARIANT...
bench_vs_megadlms() {
  local shapes=$1; shift
  local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  local budget=${BENCH_BUDGET:-565}  # seconds for all rows (less when the call also installs the staged wheels)
  CUDA_VISIBLE_DEVICES=0 timeout $((budget + 10)) python3 scripts/benchmark.py model=1.7b data.seq_len=4096 \
    train.micro_batch_size=4 train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate \
    --steps 6 --warmup 3 --batches 2 --row-timeout "${ROW_TIMEOUT:-130}" --time-budget "$budget" --json "$OUT/bench.json" \
    --megadlms .megadlms --megadlms-shapes "$shapes" --megadlms-precisions "${MEGADLMS_PRECISIONS:-bf16,fp8}" \
    --megadlms-timeout 150 "${variants[@]}" > "$OUT/bench.log" 2>&1
}
# rows of model=125m (S=1024, micro-batch 32 x 2) on the current GPU within BUDGET s: bench_small BUDGET JSON VARIANT...
# (PROFILE=NAME[,NAME] profiles those rows)
bench_small() {
  local budget=$1 json=$2; shift 2
  local variants=(); for v in "$@"; do variants+=(--variant "$v"); done
  timeout $((budget + 10)) python3 scripts/benchmark.py model=125m data.seq_len=1024 train.micro_batch_size=32 \
    train.global_batch_size=64 precision=bf16 device=cuda --no-reference --isolate --steps 8 --warmup 3 \
    --batches 2 --row-timeout 80 --time-budget "$budget" --json "$OUT/$json" ${PROFILE:+--profile "$PROFILE"} \
    "${variants[@]}" 2>&1 | tail -40
}
# one model=1.7b row (S=4096, micro-batch 4 x 4) on the current GPU: bench_row NAME OVERRIDES JSON [--profile NAME]
bench_row() {
  local name=$1 overrides=$2 json=$3; shift 3
  timeout 120 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 \
    --batches 2 --row-timeout 115 --json "$OUT/$json" "$@" --variant "$name: $overrides" 2>&1 | tail -45
}
# the trainer's model=125m shape of issue 17 (TE BF16, S=1024, one micro-batch of 64), and its benchmark row on
# GPU 0 within BUDGET s, started in the background: bench_125m_gpu0 BUDGET
TRAIN125="model=125m $T precision=bf16 data.seq_len=1024 train.micro_batch_size=64 train.global_batch_size=64"
bench_125m_gpu0() {
  ( CUDA_VISIBLE_DEVICES=0 bench_small "$1" bench_small.json "125m-te-bf16-mb64: $T train.micro_batch_size=64" \
    > "$OUT/bench.log" 2>&1 ) &
}
# after a part's GPU 0 job and GPU 1 subshell were started in the background: wait, then print both logs
report_two_gpus() {
  wait
  tail -60 "$OUT/bench.log"; echo; echo "=== GPU 1"; cat "$OUT/gpu1.log"
}
# the trainer (difflm-train) for STEPS steps and the median tokens/s of its metrics.jsonl after step 5: train_rate NAME STEPS OVERRIDE...
# (LOG_EVERY=N logs every N steps, default 1: then each step also waits for its metrics)
train_rate() {
  local name=$1 steps=$2; shift 2
  rm -rf "/tmp/$name" && timeout "${TRAIN_TIMEOUT:-200}" python3 -m difflm.train "$@" device=cuda train.max_steps="$steps" \
    train.eval_every=0 train.save_every=0 logger.log_every="${LOG_EVERY:-1}" logger.progress_bar=false logger.num_samples=0 \
    data.cache_dir="/tmp/$name-cache" objective.random_length_prob=0 run.dir="/tmp/$name" > "$OUT/$name.log" 2>&1
  tail -2 "$OUT/$name.log"
  python3 -c "import json,statistics as st; r=[json.loads(l) for l in open('/tmp/$name/metrics.jsonl')]; \
r=[x for x in r if 'tokens_per_s' in x and x['step'] > 5]; print('trainer $name tokens/s median', st.median(x['tokens_per_s'] for x in r), \
'mfu', st.median(x.get('mfu') or 0 for x in r), 'steps', len(r))"
}

# the CUDA tests of the SDPA kernel order (cuDNN first on Hopper), SDPA in isolation in that order against PyTorch's
# FlashAttention-2 default, and the small models on the torch kernels (compiled blocks, SDPA) beside TE and FA4
sdpa_rows() {
  local C="model.backend=torch model.compile=true model.attention_backend=sdpa"
  timeout 150 python3 -m pytest tests/test_sdpa_priority.py tests/test_te_backend.py -q -p no:cacheprovider -rs \
    -k "sdpa or attention" 2>&1 | tail -8
  timeout 100 python3 scripts/attention_speed.py --shape 1.7b-s4096=4,4096,16,128 --shape 125m-s1024=64,1024,12,64 \
    --shape 350m-s2048=16,2048,16,64 --backend sdpa --backend sdpa-flash --gemm-between 8 --json "$OUT/attention.json"
  bench_small 300 bench_small.json "125m-torch-compiled-mb64: $C train.micro_batch_size=64" \
    "125m-te-bf16-mb64: $T train.micro_batch_size=64" "125m-flash-mb64: $F train.micro_batch_size=64" \
    "350m-torch-compiled-mb16: $C $M350_16" "350m-te-bf16-mb16: $T $M350_16" "350m-flash-mb16: $F $M350_16"
}

# quack's tuned tiles and compiled kernels from an earlier call (.device-stage/quack_cache.tgz, carried), unpacked
# into $QUACK_CACHE_DIR (default /root/quack_cache), so the 1.7B GEMM shapes are not tuned again
restore_quack_cache() {
  export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/root/quack_cache}
  [ -f .device-stage/quack_cache.tgz ] && mkdir -p "$QUACK_CACHE_DIR" && tar -xzf .device-stage/quack_cache.tgz -C "$QUACK_CACHE_DIR"
  return 0
}

case "$part" in
single)
  B="objective=bd3lm objective.block_size=16 model.attention_backend=flex"
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 \
    train.micro_batch_size=4 train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate \
    --steps 6 --warmup 2 --batches 2 --row-timeout 120 --time-budget 540 --json "$OUT/bench.json" \
    --megadlms .megadlms --megadlms-shapes 4096x16,2048x32 --megadlms-timeout 150 \
    --variant "te-bf16: $T" --variant "te-fp8: $T precision=fp8" \
    --variant "te-bf16-bd3lm: model.backend=te $B" --variant "te-fp8-bd3lm: model.backend=te precision=fp8 $B" \
    --variant "te-bf16-flash: model.backend=te model.attention_backend=flash" \
    --variant "te-bf16-s2048: $T $S2" --variant "te-fp8-s2048: $T precision=fp8 $S2" \
    > "$OUT/bench.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1 DIFFLM_TEST_REPORT=$OUT/report.jsonl
    timeout 200 python3 -m pytest tests/test_te_backend.py tests/test_step_syncs.py -q -p no:cacheprovider -rs \
      -k "not stand_in" 2>&1 | tail -40
    timeout 200 python3 scripts/benchmark.py data.seq_len=4096 train.micro_batch_size=1 train.global_batch_size=1 \
      precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 2 --batches 2 --row-timeout 60 \
      --time-budget 190 --json "$OUT/bench_moe.json" \
      --variant "moe-1b-7b-te-bf16: model=moe-1b-7b $T" --variant "dense-1b-te-bf16: model=dense-1b $T" \
      --variant "moe-1b-7b-te-fp8: model=moe-1b-7b $T precision=fp8" \
      --variant "dense-1b-te-fp8: model=dense-1b $T precision=fp8" 2>&1 | tail -30
    timeout 150 python3 scripts/benchmark.py model=125m data.seq_len=1024 train.micro_batch_size=32 \
      train.global_batch_size=64 precision=bf16 device=cuda --no-reference --isolate --steps 8 --warmup 3 \
      --batches 2 --row-timeout 70 --time-budget 145 --json "$OUT/bench_small.json" \
      --variant "125m-te-bf16: $T" --variant "350m-te-bf16: model=350m $T data.seq_len=2048 train.micro_batch_size=8 train.global_batch_size=32" \
      2>&1 | tail -20
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
layouts)
  timeout 390 python3 scripts/layout_check.py --gpus 2 --parts correctness --out "$OUT/lc" --time-budget 380 \
    --timeout 110 --steps 4 --backends te,torch --layouts ddp,fsdp,tp2,pp2,cp2 \
    -- model=125m precision=bf16 data.seq_len=1024 train.micro_batch_size=4 train.global_batch_size=16 \
    > "$OUT/layouts.log" 2>&1
  tail -30 "$OUT/layouts.log"
  for layout in ep2 fsdp; do
    timeout 90 python3 scripts/layout_check.py --gpus 2 --parts big --big-model moe-1b-7b --big-layout $layout \
      --big-backends torch --precisions bf16 --out "$OUT/moe_$layout" --timeout 85 \
      -- data.seq_len=4096 train.micro_batch_size=1 > "$OUT/moe_$layout.log" 2>&1
    tail -6 "$OUT/moe_$layout.log"
  done
  ;;
scale)
  timeout 580 python3 scripts/layout_check.py --gpus 2 --parts throughput,big --out "$OUT/scale" --time-budget 560 \
    --timeout 170 --tput-backends te --precisions bf16,fp8 --tput-model 1.7b --tput-seq 4096 --tput-micro 4 \
    --tput-accum 4 --tput-steps 8 --warmup 3 --dp-layout ddp --tp-layouts bf16@tp2 \
    --tput-variants ddp:parallel.reduce_dtype=bf16,tp2:parallel.tp_comm_overlap=true \
    --big-model 8b --big-layout fsdp --big-micro 1 --big-precisions bf16 > "$OUT/scale.log" 2>&1
  tail -40 "$OUT/scale.log"
  ;;
profile)
  export DIFFLM_TEST_REPORT=$OUT/report.jsonl
  timeout 80 python3 -m pytest tests/test_moe.py -q -p no:cacheprovider -rs -k cuda 2>&1 | tail -8
  timeout 180 python3 scripts/benchmark.py data.seq_len=4096 train.micro_batch_size=1 train.global_batch_size=1 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 2 --batches 2 --row-timeout 60 \
    --time-budget 170 --json "$OUT/bench_moe.json" --profile moe-1b-7b-te-bf16 \
    --variant "moe-1b-7b-te-bf16: model=moe-1b-7b $T" --variant "dense-1b-te-bf16: model=dense-1b $T" \
    --variant "moe-1b-7b-torch-bf16: model=moe-1b-7b" --variant "moe-1b-7b-te-fp8: model=moe-1b-7b $T precision=fp8" \
    > "$OUT/bench_moe.log" 2>&1
  tail -30 "$OUT/bench_moe.log"
  timeout 280 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 2 \
    --batches 2 --row-timeout 90 --time-budget 270 --json "$OUT/bench.json" --profile te-bf16,te-fp8 \
    --megadlms .megadlms --megadlms-shapes 4096x16 --megadlms-timeout 100 \
    --variant "te-bf16: $T" --variant "te-fp8: $T precision=fp8" > "$OUT/bench.log" 2>&1
  tail -60 "$OUT/bench.log"
  ;;
speed)
  # issue 17 on 2 GPUs. GPU 0: model=1.7b against MegaDLMs, the fused QKV kernel and in-place FP32 weight-gradient
  # accumulation (the defaults) against both off ("unfused"). GPU 1: the CUDA tests of the changed paths, the small
  # models both ways, a profile of the new 1.7B BF16 step, and the trainer (difflm-train, metrics.jsonl) at 350m.
  U="model.fused_qkv=false model.fuse_wgrad_accumulation=false"
  M350="model=350m data.seq_len=2048 train.micro_batch_size=8 train.global_batch_size=32"
  bench_vs_megadlms 4096x16,2048x32 "te-bf16: $T" "te-fp8: $T precision=fp8" "te-bf16-unfused: $T $U" \
    "te-fp8-dpa: $T precision=fp8 precision.fp8_attention=true" "te-bf16-s2048: $T $S2" \
    "te-fp8-s2048: $T precision=fp8 $S2" &
  (
    export CUDA_VISIBLE_DEVICES=1 DIFFLM_TEST_REPORT=$OUT/report.jsonl
    timeout 170 python3 -m pytest tests/test_qkv.py tests/test_te_backend.py tests/test_step_syncs.py -q \
      -p no:cacheprovider -rs -x -k "not stand_in" 2>&1 | tail -25
    bench_small 165 bench_small.json "125m-te-bf16: $T" "125m-te-bf16-unfused: $T $U" "350m-te-bf16: $T $M350" \
      "350m-te-bf16-unfused: $T $U $M350"
    bench_row te-bf16 "$T" bench_profile.json --profile te-bf16
    train_rate tr350 25 $T precision=bf16 $M350
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed2)
  # issue 17, the call after "speed": the same comparison again (repeatability), FlashAttention 4 rows, and a profile
  # of the FP8 step; small models against the torch kernels' compiled blocks.
  M350="model=350m data.seq_len=2048 train.micro_batch_size=8 train.global_batch_size=32"
  bench_vs_megadlms 4096x16 "te-bf16: $T" "te-fp8: $T precision=fp8" "te-bf16-flash: $F" \
    "te-fp8-flash: $F precision=fp8" &
  (
    export CUDA_VISIBLE_DEVICES=1
    bench_row te-fp8 "$T precision=fp8" bench_profile.json --profile te-fp8
    bench_small 410 bench_small.json "125m-te-bf16: $T" "125m-torch-compiled: model.compile=true" \
      "125m-te-bf16-flash: $F" "350m-te-bf16: $T $M350" "350m-torch-compiled: model.compile=true $M350"
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed3)
  # issue 17, a third call: the comparison again with the fastest attention per precision (FA4 for BF16, TE's FP8
  # attention for FP8) at both shapes; on GPU 1 the trainer at model=1.7b against the benchmark row on the same GPU,
  # and the small models at two micro-batch sizes.
  D="$T precision=fp8 precision.fp8_attention=true"
  M350="model=350m data.seq_len=2048 train.global_batch_size=32"
  bench_vs_megadlms 4096x16,2048x32 "te-bf16-flash: $F" "te-fp8-dpa: $D" "te-bf16: $T" "te-fp8: $T precision=fp8" \
    "te-bf16-flash-s2048: $F $S2" "te-fp8-dpa-s2048: $D $S2" &
  (
    export CUDA_VISIBLE_DEVICES=1
    bench_row te-bf16 "$T" bench_gpu1.json | grep "^te-bf16 " | tail -1
    train_rate tr17 22 model=1.7b $T precision=bf16 data.seq_len=4096 train.micro_batch_size=4 train.global_batch_size=16
    bench_small 250 bench_small.json "125m-te-bf16: $T" "125m-te-bf16-mb64: $T train.micro_batch_size=64" \
      "125m-flash-mb64: $F train.micro_batch_size=64" "350m-te-bf16: $T $M350 train.micro_batch_size=8" \
      "350m-te-bf16-mb16: $T $M350 train.micro_batch_size=16" "350m-flash-mb16: $F $M350 train.micro_batch_size=16"
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed4)
  # issue 17, session 21: TE's fused cross-entropy (model.fused_cross_entropy, default on) against the unfused FP32
  # path, and why FP8 at S=2048 runs no faster than BF16 (GPU-busy share of a profile; micro-batch 8). GPU 1: the
  # CUDA tests of the changed paths, the small models both ways with a 125m profile, the FP8 S=2048 profile.
  C="model.fused_cross_entropy=false"
  M350="model=350m data.seq_len=2048 train.micro_batch_size=8 train.global_batch_size=32"
  bench_vs_megadlms 4096x16,2048x32 "te-bf16: $T" "te-bf16-unfused-ce: $T $C" "te-fp8: $T precision=fp8" \
    "te-bf16-s2048: $T $S2" "te-fp8-s2048: $T precision=fp8 $S2" "te-fp8-s2048-mb8: $T precision=fp8 $S2 train.micro_batch_size=8" &
  (
    export CUDA_VISIBLE_DEVICES=1 DIFFLM_TEST_REPORT=$OUT/report.jsonl
    timeout 150 python3 -m pytest tests/test_cross_entropy.py tests/test_te_backend.py -q -p no:cacheprovider -rs \
      -k "not stand_in" 2>&1 | tail -15
    PROFILE=125m-te-bf16 bench_small 200 bench_small.json "125m-te-bf16: $T" "125m-te-bf16-unfused-ce: $T $C" \
      "350m-te-bf16: $T $M350" "350m-te-bf16-unfused-ce: $T $C $M350"
    bench_row te-fp8-s2048 "$T precision=fp8 $S2" bench_profile.json --profile te-fp8-s2048 --profile-rows 30
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed5)
  # issue 17, session 21, the call after speed4: the comparison again (repeatability) with the fused cross-entropy
  # on; GPU 1: MegaDLMs FP8 at S=2048 with micro-batch 8 beside difflm's micro-batch 8 rows (is the host-bound
  # micro-batch 4 the fair shape?), the small models at their larger micro-batches, the trainer at 125m.
  bench_vs_megadlms 4096x16,2048x32 "te-bf16: $T" "te-fp8: $T precision=fp8" "te-fp8-dpa: $T precision=fp8 precision.fp8_attention=true" \
    "te-bf16-flash: $F" "te-bf16-s2048: $T $S2" "te-fp8-s2048: $T precision=fp8 $S2" &
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 170 python3 scripts/megadlms_baseline.py run --megadlms .megadlms --seq-len 2048 --global-batch 32 \
      --micro-batch 8 --precision fp8 --timeout 160 --json "$OUT/megadlms_mb8.json" 2>&1 | tail -3
    bench_row te-fp8-s2048-mb8 "$T precision=fp8 $S2 train.micro_batch_size=8" bench_gpu1.json | grep "^te-fp8" | tail -1
    bench_small 200 bench_small.json "125m-te-bf16-mb64: $T train.micro_batch_size=64" \
      "125m-flash-mb64: $F train.micro_batch_size=64" \
      "350m-te-bf16-mb16: $T $M350_16" \
      "350m-flash-mb16: $F $M350_16"
    train_rate tr125 40 $TRAIN125
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed6)
  # issue 17, session 21, a third call: the small models again (repeatability) and at larger micro-batches (GPU 0);
  # the trainer at 125m logging every step and every 10 steps (the default) against the benchmark rows (GPU 1).
  M350="model=350m data.seq_len=2048 train.global_batch_size=32"
  ( CUDA_VISIBLE_DEVICES=0 bench_small 300 bench_small.json "125m-te-bf16-mb64: $T train.micro_batch_size=64" \
      "125m-flash-mb64: $F train.micro_batch_size=64" \
      "125m-flash-mb128: $F train.micro_batch_size=128 train.global_batch_size=128" \
      "350m-flash-mb16: $F $M350 train.micro_batch_size=16" "350m-flash-mb32: $F $M350 train.micro_batch_size=32" \
    > "$OUT/bench.log" 2>&1 ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    train_rate tr125 40 $TRAIN125
    LOG_EVERY=10 train_rate tr125-log10 80 $TRAIN125
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
trainer_gaps)
  # issue 17: where the trainer's step at model=125m loses ~20 % against the benchmark row: a torch.profiler trace of
  # 2 trainer steps (profile.enabled) read by scripts/trace_gaps.py (GPU busy share, largest idle gaps and the host
  # work during them); the benchmark row on the other GPU for the same-call figure.
  bench_125m_gpu0 120
  (
    export CUDA_VISIBLE_DEVICES=1
    train_rate tr125p 12 $TRAIN125 profile.enabled=true profile.wait=6 profile.warmup=2 profile.active=2
    for f in /tmp/tr125p/profile/*.json*; do python3 scripts/trace_gaps.py "$f" --top 14; done
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
trainer125)
  # issue 17: the trainer at model=125m with the next step's data and noise prepared on the data thread (after
  # trainer_gaps), against the benchmark row on the other GPU in the same call
  bench_125m_gpu0 100
  ( CUDA_VISIBLE_DEVICES=1 train_rate tr125 30 $TRAIN125 ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
speed7)
  # issue 17, session 22: the comparison again (repeatability; speed5's rows) on GPU 0, and with a second GPU the
  # sdpa part below on it
  bench_vs_megadlms 4096x16,2048x32 "te-bf16: $T" "te-fp8: $T precision=fp8" "te-fp8-dpa: $T precision=fp8 precision.fp8_attention=true" \
    "te-bf16-flash: $F" "te-bf16-s2048: $T $S2" "te-fp8-s2048: $T precision=fp8 $S2" &
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then ( CUDA_VISIBLE_DEVICES=1 sdpa_rows ) > "$OUT/gpu1.log" 2>&1 &
  else echo "one GPU: run the sdpa part in its own call" > "$OUT/gpu1.log"; fi
  report_two_gpus
  ;;
sdpa)
  # issue 17, session 22, one GPU: the SDPA kernel order (cuDNN first on Hopper) tested and timed (sdpa_rows)
  CUDA_VISIBLE_DEVICES=0 sdpa_rows
  ;;
fp8small)
  # issue 17, session 22, one GPU: FP8 at the small models beside their BF16 row; the trainer in the host-bound case
  # (model=1.7b FP8, S=2048, micro-batch 4: does the data thread cost the launching thread?) against its benchmark
  # row; the torch kernels at model=1.7b, S=4096 (compiled blocks, SDPA in the cuDNN-first order)
  export CUDA_VISIBLE_DEVICES=0
  bench_small 170 bench_small.json "125m-te-bf16-mb64: $T train.micro_batch_size=64" \
    "125m-te-fp8-mb64: $T precision=fp8 train.micro_batch_size=64" "350m-te-bf16-mb16: $T $M350_16" \
    "350m-te-fp8-mb16: $T precision=fp8 $M350_16"
  bench_row te-fp8-s2048 "$T precision=fp8 $S2" bench_fp8_s2048.json | grep "^te-fp8" | tail -1
  train_rate tr17fp8 24 model=1.7b $T precision=fp8 $S2 train.micro_batch_size=4
  bench_row torch-compiled "model.backend=torch model.compile=true" bench_torch.json | grep "^torch" | tail -1
  ;;
fp8flash)
  # issue 17, next: FP8 with FlashAttention 4 at the small models (FA4 is 9-17 % faster than cuDNN under load there),
  # the allocator test on the GPU, and the trainer at 1.7B FP8 S=2048 with train.expandable_segments set by difflm
  # itself (fp8small measured it through the environment variable) against its benchmark row
  export CUDA_VISIBLE_DEVICES=0
  timeout 120 python3 -m pytest tests/test_allocator.py tests/test_sdpa_priority.py -q -p no:cacheprovider -rs 2>&1 | tail -4
  bench_small 200 bench_small.json "125m-te-fp8-mb64: $T precision=fp8 train.micro_batch_size=64" \
    "125m-flash-fp8-mb64: $F precision=fp8 train.micro_batch_size=64" "350m-te-fp8-mb16: $T precision=fp8 $M350_16" \
    "350m-flash-fp8-mb16: $F precision=fp8 $M350_16"
  bench_row te-fp8-s2048 "$T precision=fp8 $S2" bench_fp8_s2048.json | grep "^te-fp8" | tail -1
  train_rate tr17fp8 24 model=1.7b $T precision=fp8 $S2 train.micro_batch_size=4
  ;;
graphs)
  # issue 17, session 23, one GPU: CUDA graphs of the TE blocks (train.cuda_graphs) tested against eager training
  # (BF16, FP8), the allocator's GPU test; graphed against eager rows at model=1.7b S=2048 (the host-bound FP8 row) and
  # S=4096, FP8 + FA4 at 350m; the trainer with graphs at 1.7B FP8 S=2048 beside its benchmark rows
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  G="train.cuda_graphs=true"
  timeout 120 python3 -m pytest tests/test_cuda_graphs.py tests/test_allocator.py -q -p no:cacheprovider -rs 2>&1 | tail -6
  grep cuda_graphs_vs_eager "$OUT/report.jsonl"
  timeout 250 python3 scripts/benchmark.py model=1.7b $S2 train.micro_batch_size=4 precision=bf16 device=cuda \
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 90 --time-budget 240 \
    --json "$OUT/bench_s2048.json" --variant "te-fp8-s2048: $T precision=fp8" \
    --variant "te-fp8-s2048-graphs: $T precision=fp8 $G" --variant "te-bf16-s2048: $T" \
    --variant "te-bf16-s2048-graphs: $T $G" 2>&1 | tail -8
  train_rate tr17fp8g 24 model=1.7b $T precision=fp8 $S2 train.micro_batch_size=4 $G
  grep "CUDA graphs" "$OUT/tr17fp8g.log"
  bench_row te-fp8-dpa-graphs "$T precision=fp8 precision.fp8_attention=true $G" bench_s4096.json | grep "^te-fp8" | tail -1
  ;;
speed8)
  # issue 17, session 23, one GPU: the comparison against MegaDLMs at both shapes in one call with the FP8 rows
  # graphed (train.cuda_graphs), beside the BF16 rows (GPU-bound: graphs do not move them, call "graphs")
  G="train.cuda_graphs=true"
  bench_vs_megadlms 4096x16,2048x32 "te-bf16: $T" "te-fp8-graphs: $T precision=fp8 $G" \
    "te-fp8-dpa-graphs: $T precision=fp8 precision.fp8_attention=true $G" "te-bf16-s2048: $T $S2" \
    "te-fp8-s2048-graphs: $T precision=fp8 $S2 $G" "te-fp8-dpa-s2048-graphs: $T precision=fp8 precision.fp8_attention=true $S2 $G"
  tail -25 "$OUT/bench.log"
  ;;
smallgraphs)
  # issue 17, session 23, one GPU: graphed against eager training on a wider model (4 micro-batches a step); the FP8
  # row at S=4096 eager and graphed (speed8's graphed FP8 row ended at loss 10.4, eager rows at 9.7-9.9: FP8 noise or
  # the graphs?); the small models with FP8 (+ FA4) eager and graphed
  G="train.cuda_graphs=true"
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  timeout 100 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider -rs -k wide 2>&1 | tail -3
  grep cuda_graphs_vs_eager "$OUT/report.jsonl"
  bench_row te-fp8 "$T precision=fp8" bench_te-fp8.json | grep "^te-fp8" | tail -1
  bench_row te-fp8-graphs "$T precision=fp8 $G" bench_te-fp8-graphs.json | grep "^te-fp8" | tail -1
  bench_small ${SMALL_BUDGET:-280} bench_small.json "125m-te-fp8-mb64: $T precision=fp8 train.micro_batch_size=64" \
    "125m-te-fp8-mb64-graphs: $T precision=fp8 train.micro_batch_size=64 $G" \
    "125m-flash-fp8-mb64-graphs: $F precision=fp8 train.micro_batch_size=64 $G" \
    "350m-te-fp8-mb16: $T precision=fp8 $M350_16" "350m-te-fp8-mb16-graphs: $T precision=fp8 $M350_16 $G" \
    "350m-flash-fp8-mb16-graphs: $F precision=fp8 $M350_16 $G"
  ;;
speed9)
  # issue 17, session 24, one GPU: the revised graphed-against-eager GPU tests; micro-batch 8 at S=4096 (same global
  # batch 16: two micro-batches a step, twice the rows per GEMM) for FP8 + FP8 attention and BF16 (+ FA4) beside the
  # micro-batch 4 rows, the FP8 micro-batch 8 row profiled (ms per kernel class)
  G="train.cuda_graphs=true" D="precision=fp8 precision.fp8_attention=true" MB8="train.micro_batch_size=8"
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  timeout 150 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider -rs 2>&1 | tail -6
  grep cuda_graphs_vs_eager "$OUT/report.jsonl"
  budget=${BENCH_BUDGET:-400}
  timeout $((budget + 10)) python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=4 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 \
    --row-timeout 130 --time-budget "$budget" --json "$OUT/bench_mb8.json" --profile te-fp8-dpa-mb8 --profile-rows 30 \
    --variant "te-fp8-dpa-graphs: $T $D $G" --variant "te-fp8-dpa-mb8: $T $D $MB8" \
    --variant "te-fp8-dpa-mb8-graphs: $T $D $MB8 $G" --variant "te-bf16: $T" --variant "te-bf16-mb8: $T $MB8" \
    --variant "te-bf16-flash-mb8: $F $MB8" > "$OUT/bench.log" 2>&1
  tail -70 "$OUT/bench.log"
  ;;
speed10)
  # issue 17, session 24, one GPU (the call after speed9, same machine): the comparison against MegaDLMs at both shapes
  # with difflm at micro-batch 8 (same global batches), FP8 + FP8 attention and BF16 + FA4, beside the default BF16 row
  BENCH_BUDGET=${BENCH_BUDGET:-560} bench_vs_megadlms 4096x16,2048x32 \
    "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8" "te-bf16-flash-mb8: $F $MB8" \
    "te-bf16-flash-s2048-mb8: $F $S2 $MB8" "te-fp8-s2048-mb8: $T precision=fp8 $S2 $MB8" "te-bf16: $T"
  tail -22 "$OUT/bench.log"
  ;;
mb8fair)
  # issue 17, session 24, one GPU: MegaDLMs at micro-batch 8 too (S=4096, global batch 16; is micro-batch 8 a lever
  # only difflm gets?), difflm's FP8 micro-batch 8 row, and the trainer at that shape against it
  export CUDA_VISIBLE_DEVICES=0
  D="precision=fp8 precision.fp8_attention=true"
  for p in fp8 bf16; do
    timeout 170 python3 scripts/megadlms_baseline.py run --megadlms .megadlms --seq-len 4096 --global-batch 16 \
      --micro-batch 8 --precision $p --timeout 160 --json "$OUT/megadlms_mb8_$p.json" 2>&1 | tail -3
  done
  bench_row te-fp8-dpa-mb8 "$T $D train.micro_batch_size=8" bench_mb8.json | grep "^te-fp8" | tail -1
  train_rate tr17fp8mb8 22 model=1.7b $T $D data.seq_len=4096 train.global_batch_size=16 train.micro_batch_size=8
  ;;
mb8profile)
  # issue 17, session 24, one GPU: the BF16 + FA4 micro-batch 8 rows profiled (ms per kernel class: the targets they
  # miss), then the S=2048 BF16 micro-batch 8 rows twice each with FA4 and cuDNN attention (repeatability)
  export CUDA_VISIBLE_DEVICES=0
  timeout 250 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=8 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 \
    --row-timeout 120 --time-budget 240 --json "$OUT/bench_prof.json" \
    --profile te-bf16-flash-mb8,te-bf16-flash-s2048-mb8 --profile-rows 30 \
    --variant "te-bf16-flash-mb8: $F" --variant "te-bf16-flash-s2048-mb8: $F $S2" > "$OUT/bench.log" 2>&1
  grep -A3 "^row\|kernel time shares" "$OUT/bench.log" | cut -c1-200
  timeout 250 python3 scripts/benchmark.py model=1.7b $S2 train.micro_batch_size=8 precision=bf16 device=cuda \
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 80 --time-budget 240 \
    --json "$OUT/bench_rep.json" --variant "flash-a: $F" --variant "flash-b: $F" --variant "te-a: $T" \
    --variant "te-b: $T" 2>&1 | grep -A6 "^row" | cut -c1-200
  ;;
attn)
  # issue 17: attention in isolation per backend / layout / shape, alone and between MLP-sized GEMMs
  # (scripts/attention_speed.py), the 1.7B BF16 row with TE's cuDNN norm kernels against its default on the same GPU
  # (GPU 0, after the 125m benchmark row); the trainer at 125m with the data thread and a profiled 350m row (GPU 1)
  (
    export CUDA_VISIBLE_DEVICES=0
    bench_small 100 bench_small.json "125m-te-bf16-mb64: $T train.micro_batch_size=64"
    timeout 150 python3 scripts/attention_speed.py --shape 1.7b-s4096=4,4096,16,128 --shape 1.7b-s2048=4,2048,16,128 \
      --shape 350m-s2048=16,2048,16,64 --shape 125m-s1024=64,1024,12,64 --backend te --backend te-sbhd \
      --backend sdpa-cudnn --backend sdpa-flash --backend flash --gemm-between 0 --gemm-between 8 \
      --json "$OUT/attention.json"
    bench_row te-bf16 "$T" bench_1p7b.json
    NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1 bench_row te-bf16-cudnn-norm "$T" bench_1p7b_norm.json
  ) > "$OUT/bench.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    train_rate tr125 30 $TRAIN125
    PROFILE=350m-te-bf16-mb16 bench_small 120 bench_350m.json \
      "350m-te-bf16-mb16: $T $M350_16"
  ) > "$OUT/gpu1.log" 2>&1 &
  report_two_gpus
  ;;
qkvtriton)
  # issue 17, session 26, one GPU: the Triton QKV split / QK-norm / RoPE kernels against eager on the GPU, timed against
  # torch.compile of the same function (the path they replace), then the micro-batch 8 rows of model=1.7b with them
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  timeout 200 python3 -m pytest tests/test_qkv.py tests/test_te_backend.py -q -p no:cacheprovider -rs -x 2>&1 | tail -6
  grep qkv_triton "$OUT/report.jsonl"
  timeout 120 python3 scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --shape 350m-mb16=16,2048,16,16,64 \
    --shape 125m-mb64=64,1024,12,12,64 --json "$OUT/qkv_speed.json" 2>&1 | tail -32
  timeout 280 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 120 \
    --time-budget 270 --json "$OUT/bench_qkv.json" --profile te-bf16-flash-mb8 --profile-rows 40 \
    --variant "te-bf16-flash-mb8: $F" --variant "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true" \
    --variant "te-bf16-flash-s2048-mb8: $F $S2" > "$OUT/bench.log" 2>&1
  grep -A5 "^row" "$OUT/bench.log" | cut -c1-200
  ;;
qkvtriton2)
  # issue 17, session 26, one GPU: the QKV kernels again (backward on (row tile, KV group) programs), timed per tile
  # setting; the trainer at the FP8 micro-batch 8 shape beside its benchmark row
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  D="precision=fp8 precision.fp8_attention=true" MB8="train.micro_batch_size=8"
  timeout 100 python3 -m pytest tests/test_qkv.py -q -p no:cacheprovider -rs 2>&1 | tail -3
  grep qkv_triton "$OUT/report.jsonl"
  timeout 100 python3 scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --shape 125m-mb64=64,1024,12,12,64 \
    --tiles 8x2,16x2,16x4,32x4,32x8,64x8 --json "$OUT/qkv_speed.json" 2>&1 | tail -20
  bench_row te-fp8-dpa-mb8 "$T $D $MB8" bench_mb8.json | grep "^te-fp8" | tail -1
  train_rate tr17fp8mb8 22 model=1.7b $T $D data.seq_len=4096 train.global_batch_size=16 $MB8
  ;;
speed11)
  # issue 17, session 26, one GPU: the comparison against MegaDLMs at both shapes with the Triton QKV kernels
  BENCH_BUDGET=${BENCH_BUDGET:-570} bench_vs_megadlms 4096x16,2048x32 \
    "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8" "te-bf16-flash-mb8: $F $MB8" \
    "te-bf16-flash-s2048-mb8: $F $S2 $MB8" "te-fp8-s2048-mb8: $T precision=fp8 $S2 $MB8"
  tail -22 "$OUT/bench.log"
  ;;
fusedmlp)
  # issue 17, session 27, one GPU: the MLP half block on quack's fused GEMMs (model.fused_mlp) tested, timed alone
  # against TE's LayerNormMLP + residual adds (quack's default tiles, then autotuned), then in the BF16 + FA4 rows
  # with and without it. Needs SITE=<a directory named site-packages> (the staged wheels' directory linked there):
  # quack keys its compiled kernels by the code they call and treats only code under site-packages as library code
  timeout 300 python3 -m pytest tests/test_quack_mlp.py -q -p no:cacheprovider -rs -x 2>&1 | tail -6
  timeout 200 python3 scripts/mlp_speed.py --shape 1.7b-mb8=32768,2048,6144 --shape 350m-mb16=32768,1024,2816 \
    --json "$OUT/mlp.json" 2>&1 | tail -2
  timeout 330 python3 scripts/mlp_speed.py --shape 1.7b-mb8=32768,2048,6144 --autotune --json "$OUT/mlp_tuned.json" \
    2>&1 | tail -1
  timeout ${BENCH_BUDGET:-300} python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=8 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 \
    --row-timeout 180 --time-budget "${BENCH_BUDGET:-300}" --json "$OUT/bench.json" \
    --variant "te-bf16-flash-mb8: $F" \
    --variant "te-bf16-flash-mb8-fusedmlp: $F model.fused_mlp=true model.fused_mlp_autotune=true" \
    > "$OUT/bench.log" 2>&1
  tail -22 "$OUT/bench.log"
  ;;
speed12)
  # issue 17, session 27, one GPU: the comparison against MegaDLMs with the fused MLP in the BF16 rows (run after
  # fusedmlp on the same machine, so quack's autotuning cache holds the S=4096 shapes)
  BENCH_BUDGET=${BENCH_BUDGET:-560} bench_vs_megadlms 4096x16,2048x32 "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM" \
    "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8" \
    "te-bf16-flash-s2048-mb8-fusedmlp: $F $S2 $MB8 $FM" "te-fp8-s2048-mb8: $T precision=fp8 $S2 $MB8"
  tail -22 "$OUT/bench.log"
  ;;
trainfused)
  # issue 17, session 27, one GPU: the fused MLP's tests and difflm-train with it (BF16 + FA4, micro-batch 8, S=4096)
  timeout 200 python3 -m pytest tests/test_quack_mlp.py -q -p no:cacheprovider -rs -x 2>&1 | tail -3
  TRAIN_TIMEOUT=330 train_rate trainer-bf16-fused 22 model=1.7b $F precision=bf16 data.seq_len=4096 \
    train.micro_batch_size=8 train.global_batch_size=16 model.fused_mlp=true model.fused_mlp_autotune=true
  ;;
settle)
  # issue 17, session 28, one GPU: difflm-train reading each step's outcome after launching the next (no drain of the
  # device queue per step) beside its benchmark row (profiled) and beside the trainer of the commit before (exported
  # with `git archive <rev> difflm conf pyproject.toml` into .device-stage/old, carried), at the BF16 + FA4 + fused MLP
  # (autotuned) micro-batch 8 shape; quack's cache (tuned tiles, compiled kernels) comes back as quack_cache.tgz
  export CUDA_VISIBLE_DEVICES=0 QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/root/quack_cache}
  timeout 100 python3 -m pytest tests/test_step_syncs.py -q -p no:cacheprovider -rs 2>&1 | tail -3
  timeout 330 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 320 \
    --json "$OUT/bench.json" --profile te-bf16-flash-mb8-fusedmlp --variant "te-bf16-flash-mb8-fusedmlp: $F $FM" \
    > "$OUT/bench.log" 2>&1
  grep -A3 "^row " "$OUT/bench.log" | tail -2; grep -i "busy\|share" "$OUT/bench.log" | tail -3
  TRAIN_TIMEOUT=150 train_rate trainer-bf16-fused 22 model=1.7b $F precision=bf16 data.seq_len=4096 $MB8 \
    train.global_batch_size=16 $FM
  [ -d .device-stage/old ] && PYTHONPATH=$PWD/.device-stage/old:$PYTHONPATH TRAIN_TIMEOUT=150 train_rate \
    trainer-bf16-fused-before 22 model=1.7b $F precision=bf16 data.seq_len=4096 $MB8 train.global_batch_size=16 $FM
  tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" . && ls -la "$OUT/quack_cache.tgz"
  ;;
speed13)
  # issue 17, session 28, one GPU: the BF16 comparison against MegaDLMs again, with S=2048 also at micro-batch 16
  # (32 k tokens a micro-batch, as S=4096 at 8); quack's cache of `settle` unpacked first when carried
  # (.device-stage/quack_cache.tgz), so the 32 k-token shapes are not tuned again
  restore_quack_cache
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-540} bench_vs_megadlms 4096x16,2048x32 \
    "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM" "te-bf16-flash-s2048-mb16-fusedmlp: $F $S2 train.micro_batch_size=16 $FM" \
    "te-bf16-flash-s2048-mb8-fusedmlp: $F $S2 $MB8 $FM"
  tail -12 "$OUT/bench.log"
  ;;
speed14)
  # issue 17, session 28, one GPU: every 1.7B target against MegaDLMs (BF16 and FP8) in one call, run after speed13
  # on the same machine (quack's cache holds the 32 k-token shapes); S=2048 BF16 at micro-batch 16
  export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/root/quack_cache}
  BENCH_BUDGET=${BENCH_BUDGET:-560} bench_vs_megadlms 4096x16,2048x32 "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM" \
    "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8" \
    "te-bf16-flash-s2048-mb16-fusedmlp: $F $S2 train.micro_batch_size=16 $FM" "te-fp8-s2048-mb8: $T precision=fp8 $S2 $MB8"
  tail -14 "$OUT/bench.log"
  ;;
quackqkv)
  # issue 17, session 29, one GPU: the attention half's norm + QKV projection on quack (model.fused_mlp also builds
  # difflm.kernels.quack_norm_linear.ResidualNormLinear: the residual's gradient added in the norm kernel) and the
  # clipping inside the fused AdamW, tested; the optimizer alone; the BF16 + FA4 + fused micro-batch 8 row (its new
  # QKV shapes autotuned, profiled) beside the same row of the commit before (exported with `git archive <rev> difflm
  # conf scripts pyproject.toml` into .device-stage/old, carried); quack's cache comes back as quack_cache.tgz
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  timeout 150 python3 -m pytest tests/test_quack_mlp.py tests/test_step_syncs.py tests/test_optimizer.py -q \
    -p no:cacheprovider -rs 2>&1 | tail -4
  timeout 60 python3 scripts/optimizer_speed.py model=1.7b 2>&1 | tail -6
  ROW="--no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 300"
  timeout 310 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda $ROW --json "$OUT/bench.json" --profile te-bf16-flash-mb8-fusedmlp \
    --variant "te-bf16-flash-mb8-fusedmlp: $F $FM" > "$OUT/bench.log" 2>&1
  grep -A3 "^row " "$OUT/bench.log" | tail -2; grep -i "busy\|share\|LayerNormLinear\|NormLinear" "$OUT/bench.log" | tail -6
  tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" . && ls -la "$OUT/quack_cache.tgz"
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 150 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda $ROW --json "$OUT/bench_before.json" \
    --variant "before-te-bf16-flash-mb8-fusedmlp: $F $FM" > "$OUT/bench_before.log" 2>&1; \
    grep -A3 "^row " "$OUT/bench_before.log" | tail -2)
  ;;
speed15)
  # issue 17, session 29, one GPU: the BF16 comparison against MegaDLMs with the quack QKV input and the clipping
  # inside the fused AdamW (run after quackqkv on the same machine, or with its quack_cache.tgz carried)
  restore_quack_cache
  MEGADLMS_PRECISIONS=${MEGADLMS_PRECISIONS:-bf16} BENCH_BUDGET=${BENCH_BUDGET:-540} bench_vs_megadlms \
    ${SHAPES:-4096x16,2048x32} "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM" \
    "te-bf16-flash-s2048-mb16-fusedmlp: $F $S2 train.micro_batch_size=16 $FM" ${EXTRA_ROWS:+"$EXTRA_ROWS"}
  tail -12 "$OUT/bench.log"
  ;;
projcast)
  # issue 17, session 30, one GPU: the quack modules' BF16 weight casts made once per optimizer step, tested; the
  # BF16 + FA4 + fused micro-batch 8 row with them (profiled); quack's cache comes back as quack_cache.tgz. (When it
  # ran, the tree also had the attention output projection on quack and a QKV backward kernel taking several KV
  # groups per program; neither was kept: docs/performance.md.)
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  restore_quack_cache
  timeout 200 python3 -m pytest tests/test_quack_mlp.py tests/test_qkv.py -q -p no:cacheprovider -rs 2>&1 | tail -4
  timeout 330 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 320 \
    --json "$OUT/bench.json" --profile te-bf16-flash-mb8-fusedmlp --profile-rows 40 \
    --variant "te-bf16-flash-mb8-fusedmlp: $F $FM" > "$OUT/bench.log" 2>&1
  grep -A3 "^row " "$OUT/bench.log" | tail -2; grep -i "busy\|share" "$OUT/bench.log" | tail -4
  tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" . && ls -la "$OUT/quack_cache.tgz"
  ;;
speed16)
  # issue 17, session 30, one GPU (after projcast, or with its quack_cache.tgz carried): the quack weight gradients
  # added in place again (the mark that says so was lost when to_empty replaced the parameters: each was returned in
  # FP32 and added by autograd in a pass of its own) tested with the CUDA graphs and QKV tests; then MegaDLMs BF16 at
  # S=4096, the BF16 + FA4 + fused micro-batch 8 row of this commit and of the commit before (.device-stage/old) in
  # one call, and difflm-train at that shape
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  timeout 150 python3 -m pytest tests/test_quack_mlp.py tests/test_cuda_graphs.py tests/test_qkv.py -q -p no:cacheprovider \
    -rs -k "not interpreter" 2>&1 | grep -E "^E |FAILED|passed|failed" | head -12
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-330} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM"
  tail -8 "$OUT/bench.log"
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 150 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 140 \
    --json "$OUT/bench_before.json" --variant "before-te-bf16-flash-mb8-fusedmlp: $F $FM" > "$OUT/bench_before.log" 2>&1; \
    grep -A3 "^row " "$OUT/bench_before.log" | tail -2)
  TRAIN_TIMEOUT=150 train_rate trainer-bf16-fused 22 model=1.7b $F precision=bf16 data.seq_len=4096 $MB8 \
    train.global_batch_size=16 $FM
  ;;
projab)
  # issue 17, session 30, one GPU: the BF16 + FA4 + fused micro-batch 8 row of this tree and of .device-stage/old in
  # one call. When it ran, this tree had the attention output projection on quack's GEMM and old was the same tree
  # with TE's Linear there: quack's was 0.4 % slower, and the slot was removed (docs/performance.md)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  ROW="model=1.7b data.seq_len=4096 train.micro_batch_size=8 train.global_batch_size=16 precision=bf16 device=cuda
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 140"
  timeout 150 python3 scripts/benchmark.py $ROW --json "$OUT/bench.json" --variant "this: $F $FM" \
    > "$OUT/bench.log" 2>&1; grep -A3 "^row " "$OUT/bench.log" | tail -1
  (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages timeout 150 python3 \
    scripts/benchmark.py $ROW --json "$OUT/bench_old.json" --variant "old: $F $FM" > "$OUT/bench_old.log" 2>&1; \
    grep -A3 "^row " "$OUT/bench_old.log" | tail -1)
  ;;
qkvflash)
  # issue 17, session 31, one GPU: the QKV heads and FA4 as one autograd function (difflm.kernels.qkv_flash: v read in
  # place, FA4's gradients written into the QKV gradient's slots) tested against the two-call path, the model tests
  # (quack's in-place weight gradients, TE parity with flash); the BF16 + FA4 + fused micro-batch 8 row of this tree
  # (profiled) and of .device-stage/old (the commit before) in one call
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  restore_quack_cache
  timeout 150 python3 -m pytest tests/test_qkv.py tests/test_quack_mlp.py tests/test_te_backend.py -q -p no:cacheprovider \
    -rs -k "not interpreter and (qkv or fused or parity or flash)" 2>&1 | grep -E "^E |FAILED|passed|failed" | head -12
  ROW="model=1.7b data.seq_len=4096 train.micro_batch_size=8 train.global_batch_size=16 precision=bf16 device=cuda
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 140"
  timeout 175 python3 scripts/benchmark.py $ROW --row-timeout 165 --json "$OUT/bench.json" --profile this --profile-rows 40 \
    --variant "this: $F $FM" > "$OUT/bench.log" 2>&1; grep -A3 "^row " "$OUT/bench.log" | tail -1
  grep -i "busy\|share" "$OUT/bench.log" | tail -4
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 150 python3 scripts/benchmark.py $ROW --json "$OUT/bench_old.json" --variant "old: $F $FM" \
    > "$OUT/bench_old.log" 2>&1; grep -A3 "^row " "$OUT/bench_old.log" | tail -1)
  ;;
speed17)
  # issue 17, session 31, one GPU (after qkvflash on the same machine): MegaDLMs BF16 at S=4096 beside the BF16 +
  # FA4 + fused micro-batch 8 row with the value heads read in place, then difflm-train at that shape
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-330} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM"
  tail -8 "$OUT/bench.log"
  TRAIN_TIMEOUT=150 train_rate trainer-bf16-fused 22 model=1.7b $F precision=bf16 data.seq_len=4096 $MB8 \
    train.global_batch_size=16 $FM
  ;;
flashtiles)
  # issue 17, session 32, one GPU: FA4's SM90 forward and backward tiles swept at the 1.7B micro-batch 8, S=4096
  # attention shape, with the MLP-sized GEMMs between calls (scripts/flash_tiles.py)
  export CUDA_VISIBLE_DEVICES=0
  timeout ${TILES_BUDGET:-540} python3 scripts/flash_tiles.py --shape 8,4096,16,128 --gemm-between 8 \
    --json "$OUT/tiles.json" ${TILES_ONLY:-} 2>&1 | grep -v "^\s*$" | tail -40
  ;;
speed18)
  # issue 17, session 32, one GPU: MegaDLMs BF16 at S=4096 beside the BF16 + FA4 + fused micro-batch 8 row of this
  # tree, then the same row of .device-stage/old (the commit before) in the same call
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-330} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fusedmlp: $F $MB8 $FM"
  tail -6 "$OUT/bench.log"
  ROW="model=1.7b data.seq_len=4096 train.micro_batch_size=8 train.global_batch_size=16 precision=bf16 device=cuda
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 140"
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 150 python3 scripts/benchmark.py $ROW --json "$OUT/bench_old.json" --variant "old: $F $FM" \
    > "$OUT/bench_old.log" 2>&1; grep -A3 "^row " "$OUT/bench_old.log" | tail -1)
  ;;
recheck)
  # issue 17, session 32, one GPU: the targets last measured before sessions 29-31 changed the step, again with this
  # tree: MegaDLMs FP8 at S=4096 beside difflm's FP8 + FP8 attention micro-batch 8 row (SMALL=1: instead, the
  # 350m FP8 + FA4 and 125m BF16 + FA4 rows; SMALL=bf16: the 350m BF16 rows)
  export CUDA_VISIBLE_DEVICES=0
  if [ "${SMALL:-}" = bf16 ]; then  # 350m in BF16 + FA4, without and with the fused MLP (its tiles tuned first)
    bench_small 280 bench_small_bf16.json "350m-flash-bf16-mb16: $F $M350_16" \
      "350m-flash-bf16-mb16-fusedmlp: $F $M350_16 model.fused_mlp=true model.fused_mlp_autotune=true"
  elif [ -n "${SMALL:-}" ]; then
    bench_small 200 bench_small.json "350m-flash-fp8-mb16: $F precision=fp8 $M350_16" \
      "125m-flash-bf16-mb64: $F train.micro_batch_size=64"
  else
    MEGADLMS_PRECISIONS=fp8 BENCH_BUDGET=${BENCH_BUDGET:-300} bench_vs_megadlms 4096x16 \
      "te-fp8-dpa-mb8: $T precision=fp8 precision.fp8_attention=true $MB8"
    tail -6 "$OUT/bench.log"
  fi
  ;;
checks)
  # issue 17, session 33, one GPU: where the BF16 + FA4 + fused micro-batch 8 step's small classes go (the profile's
  # per-class kernel lists), the two timing scripts on their shared loop (benchmark.median_ms_under_load), and the
  # CUDA tests of the TE kernel set and the step's syncs
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  FM="model.fused_mlp=true model.fused_mlp_autotune=${AUTOTUNE:-false}"  # untuned GEMMs: the small classes are the question
  timeout 200 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 train.micro_batch_size=8 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 4 --warmup 3 \
    --batches 2 --row-timeout 190 --json "$OUT/bench_profile.json" --profile bf16-flash-mb8-fused --profile-rows 25 \
    --variant "bf16-flash-mb8-fused: $F $FM" > "$OUT/bench_profile.log" 2>&1
  grep -A200 "Class " "$OUT/bench_profile.log" | head -150; grep -A2 "^row " "$OUT/bench_profile.log" | tail -3
  timeout 100 python3 scripts/flash_tiles.py --shape 8,4096,16,128 --gemm-between 8 --iters 10 \
    --only bwd-default --only fwd-default 2>&1 | tail -4
  timeout 60 python3 scripts/attention_speed.py --shape 1.7b-s4096=8,4096,16,128 --backend flash --gemm-between 8 \
    2>&1 | tail -3
  timeout 200 python3 -m pytest tests/test_te_backend.py tests/test_step_syncs.py -q -p no:cacheprovider -rs -x \
    2>&1 | tail -6
  ;;
lossrows)
  # issue 17, session 34, one GPU: the last block at the loss rows (model.last_block_loss_rows): its CUDA tests (FA4
  # varlen queries in the QKV + FA4 function, quack's MLP at default tiles), then the BF16 + FA4 + fused micro-batch 8
  # row with and without it in one call (quack tunes first; its cache comes back as quack_cache.tgz)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  timeout 150 python3 -m pytest tests/test_loss_rows.py tests/test_qkv.py -q -p no:cacheprovider -rs -x \
    -k "gpu or flash" 2>&1 | tail -6
  timeout ${BENCH_BUDGET:-340} python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 \
    precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 260 \
    --time-budget $((${BENCH_BUDGET:-340} - 10)) --json "$OUT/bench_rows.json" --variant "rows: $F $MB8 $FM" \
    --variant "full: $F $MB8 $FM model.last_block_loss_rows=false" > "$OUT/bench_rows.log" 2>&1
  grep -A4 "^row " "$OUT/bench_rows.log" | cut -c1-150; tail -3 "$OUT/bench_rows.log"
  mkdir -p "$QUACK_CACHE_DIR" && tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" .
  ;;
speed19)
  # issue 17, session 34, one GPU: MegaDLMs BF16 at S=4096 beside the BF16 + FA4 + fused micro-batch 8 row with the
  # last block at the loss rows (quack's tuned tiles from .device-stage/quack_cache.tgz or this machine's cache),
  # then the same row without it (not with ROWS_ONLY=1)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-330} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fused-rows: $F $MB8 $FM"
  tail -6 "$OUT/bench.log"
  [ -n "${ROWS_ONLY:-}" ] || timeout 120 python3 scripts/benchmark.py model=1.7b data.seq_len=4096 $MB8 \
    train.global_batch_size=16 precision=bf16 device=cuda --no-reference --isolate --steps 6 --warmup 3 --batches 2 \
    --row-timeout 110 --json "$OUT/bench_full.json" \
    --variant "full: $F $MB8 $FM model.last_block_loss_rows=false" 2>&1 | grep -A3 "^row " | tail -1
  ;;
qkvbwd)
  # issue 17, session 35, one GPU: the QKV backward with several row tiles per program (fewer norm-scale partial
  # sums) tested on CUDA, then the BF16 + FA4 + fused micro-batch 8 row of this tree and of .device-stage/old (the
  # commit before), both profiled, in one call (quack tunes first unless .device-stage/quack_cache.tgz is carried;
  # its cache comes back as quack_cache.tgz)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  timeout 120 python3 -m pytest tests/test_qkv.py -q -p no:cacheprovider -rs -k "not interpreter" 2>&1 | tail -3
  ROW="model=1.7b data.seq_len=4096 train.micro_batch_size=8 train.global_batch_size=16 precision=bf16 device=cuda
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --profile-rows 30"
  timeout 300 python3 scripts/benchmark.py $ROW --row-timeout 290 --json "$OUT/bench.json" --profile this \
    --variant "this: $F $FM" > "$OUT/bench.log" 2>&1
  mkdir -p "$QUACK_CACHE_DIR" && tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" .
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 170 python3 scripts/benchmark.py $ROW --row-timeout 160 --json "$OUT/bench_old.json" --profile old \
    --variant "old: $F $FM" > "$OUT/bench_old.log" 2>&1)
  for f in bench.log bench_old.log; do echo "== $f"; grep -A3 "^row " "$OUT/$f" | tail -1
    grep -iE "qkv_heads|reduce|busy" "$OUT/$f" | head -8; done
  ;;
qkvbwd2)
  # issue 17, session 35, one GPU: the QKV kernels reading half the RoPE tables, tested on CUDA; the in-place backward
  # timed under load at several BLOCK_TxWARPSxTILES settings (scripts/qkv_speed.py --in-place), the fastest written
  # into this machine's copy of difflm/kernels/qkv_triton.py (printed); then the BF16 + FA4 + fused micro-batch 8 row
  # of that tree and of .device-stage/old, profiled, and MegaDLMs BF16 beside the row again (quack's cache carried)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  timeout 120 python3 -m pytest tests/test_qkv.py -q -p no:cacheprovider -rs -k "not interpreter" 2>&1 | tail -2
  timeout 90 python3 scripts/qkv_speed.py --shape 1.7b-mb8=8,4096,16,16,128 --gemm-between 8 --json "$OUT/qkv_speed.json" \
    --in-place ${QKV_SETTINGS:-16x2x8,16x2x1,16x4x8,32x4x4,32x2x4,32x4x8,64x4x2,8x1x16,16x2x16}
  best=$(python3 -c "import json; r=[x for x in json.load(open('$OUT/qkv_speed.json')) if x['row'] != 'forward']; \
print(min(r, key=lambda x: x['ms'])['row'].split()[1])")
  IFS=x read -r bt bw btl <<< "$best"; echo "backward setting used: $best"
  sed -i "s/^BWD_BLOCK_T, BWD_WARPS = .*/BWD_BLOCK_T, BWD_WARPS = $bt, $bw/; s/^BWD_TILES = .*/BWD_TILES = $btl/" \
    difflm/kernels/qkv_triton.py && grep -n "^BWD_" difflm/kernels/qkv_triton.py
  ROW="model=1.7b data.seq_len=4096 train.micro_batch_size=8 train.global_batch_size=16 precision=bf16 device=cuda
    --no-reference --isolate --steps 6 --warmup 3 --batches 2 --profile-rows 30 --row-timeout 160"
  timeout 170 python3 scripts/benchmark.py $ROW --json "$OUT/bench_this.json" --profile this \
    --variant "this: $F $FM" > "$OUT/bench_this.log" 2>&1
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 170 python3 scripts/benchmark.py $ROW --json "$OUT/bench_old.json" --profile old \
    --variant "old: $F $FM" > "$OUT/bench_old.log" 2>&1)
  for f in bench_this.log bench_old.log; do echo "== $f"; grep -A3 "^row " "$OUT/$f" | tail -1
    grep -E "qkv_heads|reduce_kernel|device_ms" "$OUT/$f" | grep -v "0.000us" | cut -c1-120 | head -5; done
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-200} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fused-rows: $F $MB8 $FM"
  grep -E "^megadlms|^te-bf16" "$OUT/bench.log" | cut -c1-140
  ;;
levers36)
  # issue 17, session 36, one GPU: FA4's 192 x 128 forward tile, 32 row tiles a QKV backward program, the training
  # loss writing its gradient into the logits, the embedding's gradient into main_grad: their CUDA tests (NO_TESTS=1
  # skips them); MegaDLMs BF16 beside this tree's BF16 + FA4 + fused micro-batch 8 row, then the same row of
  # .device-stage/old (the commit before)
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  [ -n "${NO_TESTS:-}" ] || timeout 200 python3 -m pytest tests/test_qkv.py tests/test_cross_entropy.py \
    tests/test_embedding.py tests/test_loss_rows.py -q -p no:cacheprovider -rfs -k "not interpreter" 2>&1 | tail -6
  MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${BENCH_BUDGET:-200} bench_vs_megadlms 4096x16 "te-bf16-flash-mb8-fused-rows: $F $MB8 $FM"
  grep -A3 "^row " "$OUT/bench.log" | cut -c1-150 | tail -3
  ROW="model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 precision=bf16 device=cuda --no-reference
    --isolate --steps 6 --warmup 3 --batches 2 --row-timeout 110"
  [ -d .device-stage/old ] && (cd .device-stage/old && PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
    timeout 120 python3 scripts/benchmark.py $ROW --json "$OUT/bench_old.json" --variant "old: $F $FM" \
    > "$OUT/bench_old.log" 2>&1)
  grep -A3 "^row " "$OUT/bench_old.log" | cut -c1-150 | tail -1
  ;;
final17)
  # issue 17, session 38, one GPU, calls on one machine, so each system's speed on that machine enters every ratio
  # (SITE=<the staged wheels installed in a directory named site-packages>, which quack's GEMMs need):
  # STEP=1 (the call that installs): MegaDLMs BF16, then difflm's BF16 + FA4 + fused micro-batch 8 row (quack tunes
  #   its shapes first; the cache comes back as quack_cache.tgz and stays in /root for STEP=2);
  # STEP=2: difflm's row, MegaDLMs BF16 again and difflm's row after it (D M D), the row profiled, and difflm-train at
  #   the same shape (median tokens/s of its metrics.jsonl);
  # STEP=3: one more pair (M D); session 38's call 65 was `gputests` and then this
  export CUDA_VISIBLE_DEVICES=0
  restore_quack_cache
  ROW="model=1.7b data.seq_len=4096 $MB8 train.global_batch_size=16 precision=bf16 device=cuda --no-reference
    --isolate --steps 6 --warmup 3 --batches 2"
  R17="te-bf16-flash-mb8-fused-rows: $F $MB8 $FM"
  pair() {  # MegaDLMs BF16, then difflm's row: pair [BUDGET_S [ROW_TIMEOUT_S]]
    MEGADLMS_PRECISIONS=bf16 BENCH_BUDGET=${1:-200} ROW_TIMEOUT=${2:-130} bench_vs_megadlms 4096x16 "$R17"
    grep -A3 "^row " "$OUT/bench.log" | cut -c1-150 | tail -3; tail -4 "$OUT/bench.log"
  }
  if [ "${STEP:-1}" = 1 ]; then
    pair "${BENCH_BUDGET:-520}" 400
    cp "$OUT/bench.log" "$OUT/bench1.log"
    mkdir -p "$QUACK_CACHE_DIR" && tar -czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" .
  elif [ "$STEP" = 3 ]; then
    pair
  else
    timeout 100 python3 scripts/benchmark.py $ROW --row-timeout 90 --json /tmp/bench_d0.json \
      --variant "$R17" > "$OUT/bench_d0.log" 2>&1
    grep -A3 "^row " "$OUT/bench_d0.log" | cut -c1-150 | tail -1
    pair
    mkdir -p /tmp/prof; timeout 130 python3 scripts/benchmark.py $ROW --row-timeout 120 --json /tmp/prof/bench_prof.json \
      --profile prof --profile-rows 30 --variant "prof: $F $FM" > "$OUT/bench_prof.log" 2>&1
    grep -A3 "^row " "$OUT/bench_prof.log" | cut -c1-150 | tail -1; grep -iE "busy|^ *(gemm|attention|optimizer|other)" "$OUT/bench_prof.log" | head -8
    cp /tmp/prof/*prof*.txt "$OUT/" 2>/dev/null
    TRAIN_TIMEOUT=150 train_rate trainer-bf16-fused 22 model=1.7b $F precision=bf16 data.seq_len=4096 $MB8 \
      train.global_batch_size=16 $FM
  fi
  ;;
gputests)
  # every test file with CUDA tests (or FILES), on GPU 0 (TESTS_BUDGET s, ONLY=<pytest -k> narrows them); figures to
  # $OUT/report.jsonl, failures in full to $OUT/tests.log; then the tests OLD_K names on .device-stage/old, to tell
  # faults of this tree from older ones
  export CUDA_VISIBLE_DEVICES=0 DIFFLM_TEST_REPORT=$OUT/report.jsonl
  restore_quack_cache
  cuda_files() { ls tests/test_{allocator,cross_entropy,cuda_graphs,embedding,loss_rows,moe,qkv,quack_mlp,sdpa_priority,step_syncs,te_backend}.py 2>/dev/null; }
  timeout "${TESTS_BUDGET:-330}" python3 -m pytest ${FILES:-$(cuda_files)} -q -p no:cacheprovider -rfs \
    -k "${ONLY:-not interpreter}" --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
  [ -n "${OLD_K:-}" ] && [ -d .device-stage/old ] && (cd .device-stage/old && DIFFLM_TEST_REPORT=$OUT/report_old.jsonl \
    PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages timeout 150 python3 -m pytest $(cuda_files) -q \
    -p no:cacheprovider -rfs -k "$OLD_K" > "$OUT/tests_old.log" 2>&1; echo "old tree:"; \
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_old.log" | tail -12)
  ;;
*) echo "unknown part $part"; exit 2 ;;
esac
