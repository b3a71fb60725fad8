#!/usr/bin/env bash
# GPU staging helper: source it (`. scripts/gpu_env.sh`) on the GPU machine before any benchmark or CUDA test.
#
#   SITE=/root/site-packages . scripts/gpu_env.sh          # set up the environment of this shell
#   bash scripts/gpu_env.sh install WHEEL_DIR              # install staged wheels into $SITE, then check the imports
#
# * The optional kernels (Transformer Engine, flash-attn 4, quack) may be installed into a directory of their own
#   (`pip install --target`). quack keys its compiled kernels by the code they call and treats only code under a
#   directory named `site-packages` as library code, so SITE must be (or link to) a folder named site-packages.
# * Transformer Engine searches the system library path for cuDNN before the Python packages; an image whose system
#   cuDNN is older than PyTorch's then fails PyTorch's cuDNN check. CUDNN_HOME and LD_LIBRARY_PATH point both at
#   PyTorch's copy.
# * NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends): it can take a shared host's GPUs down.
# * quack's tuned tiles and compiled kernels from an earlier machine, as the archive QUACK_CACHE_ARCHIVE (default
#   quack_cache.tgz, which scripts/bench_suites.sh writes to $OUT), are unpacked into QUACK_CACHE_DIR (default
#   /root/quack_cache), so the GEMM shapes are not tuned again.
#
# -h / --help prints this text; run (not sourced) with another argument than install, it says so in one line, exit 2.
# install without a folder of .whl files says so in one line, exit 2, before anything is set up; a pip install that
# fails ends with one line, exit 1.
case "${1:-}" in
  -h|--help)
    sed -n '2,/^case /p' "${BASH_SOURCE[0]}" | sed -e '/^case /d' -e 's/^# \{0,1\}//' -e 's/^#$//'
    return 0 2>/dev/null || exit 0 ;;
  "") ;;
  install)
    why=
    if [ -z "${2:-}" ]; then why="install needs WHEEL_DIR"
    elif [ ! -d "$2" ]; then why="WHEEL_DIR '$2' is not a folder"
    elif ! compgen -G "$2/*.whl" > /dev/null; then why="WHEEL_DIR '$2' holds no .whl files"
    fi
    if [ -n "$why" ]; then
      echo "gpu_env.sh: error: $why (usage: bash scripts/gpu_env.sh install WHEEL_DIR, a folder of the staged" \
        "wheels)" >&2
      return 2 2>/dev/null || exit 2
    fi ;;
  *)
    if [ "${BASH_SOURCE[0]}" = "$0" ]; then
      echo "gpu_env.sh: error: unknown argument '$1' (usage: . scripts/gpu_env.sh to set up this shell, or bash" \
        "scripts/gpu_env.sh install WHEEL_DIR; --help says more)" >&2
      exit 2
    fi ;;
esac
SITE=${SITE:-/root/site-packages}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export SITE OUT
export PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1
CUDNN_HOME=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2>/dev/null) && \
  export CUDNN_HOME LD_LIBRARY_PATH=$CUDNN_HOME/lib:${LD_LIBRARY_PATH:-}
export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/root/quack_cache}
QUACK_CACHE_ARCHIVE=${QUACK_CACHE_ARCHIVE:-quack_cache.tgz}
if [ -f "$QUACK_CACHE_ARCHIVE" ] && [ ! -d "$QUACK_CACHE_DIR" ]; then
  mkdir -p "$QUACK_CACHE_DIR" && tar -xzf "$QUACK_CACHE_ARCHIVE" -C "$QUACK_CACHE_DIR"
fi

if [ "${1:-}" = install ]; then
  mkdir -p "$SITE"
  if ! python3 -m pip install -q --no-deps --target "$SITE" "$2"/*.whl; then
    echo "gpu_env.sh: error: pip could not install the wheels of $2 into $SITE (its output is above)" >&2
    return 1 2>/dev/null || exit 1
  fi
  python3 -c "import transformer_engine.pytorch, torch; print('te', transformer_engine.__version__, 'torch', torch.__version__)"
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash-attn 4: ok" || echo "flash-attn 4: not installed"
  python3 -c "import quack" 2>/dev/null && echo "quack: ok" || echo "quack: not installed"
fi
