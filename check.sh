#!/usr/bin/env bash
# The learner's entry point. First call: creates .venv and installs the lock, requirements/ (CPU torch on
# machines without an NVIDIA GPU), with uv. Then: python -m course "$@".
#
# Which Python runs the course:
#   COURSE_PYTHON=/path/to/python   use exactly this interpreter (nothing is installed)
#   .venv/                          used once it has been set up by this script (re-installed when the lock changes)
#   the current python3             used when it already has everything (e.g. a GPU box without network)
#   COURSE_USE_VENV=1               skip that last detection and always set up .venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# Everything check.sh needs, importable and at the pinned transformers release.
READY='import sys
assert (3, 10) <= sys.version_info[:2] <= (3, 12), "Python 3.10-3.12 required"
import torch, transformers, numpy, triton, rich, pytest, pytest_timeout, safetensors, hypothesis
assert transformers.__version__ == "5.17.0", transformers.__version__'

# The lock (requirements/, course/lock.py): torch-cpu.txt or torch-cuda.txt, then cpu.txt with every hash.
torch_lock() { if command -v nvidia-smi >/dev/null 2>&1; then echo requirements/torch-cuda.txt; else echo requirements/torch-cpu.txt; fi; }
stamp() { cat "$(torch_lock)" requirements/cpu.txt | sha256sum | cut -c1-16; }

pick_base_python() {
    for py in python3 python3.12 python3.11 python3.10; do
        if command -v "$py" >/dev/null 2>&1 &&
           "$py" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    echo "check.sh: 需要 Python 3.10-3.12（没有找到合适的 python3）" >&2
    exit 2
}

bootstrap_venv() {
    local base; base=$(pick_base_python)
    echo "首次运行：创建 .venv 并按锁文件 requirements/ 安装依赖（只做一次）……" >&2
    rm -rf .venv
    "$base" -m venv --without-pip .venv
    local py=.venv/bin/python torch; torch=$(torch_lock)
    # torch's CPU build comes from the PyTorch CPU index, added only when it answers (offline mirrors and closed
    # networks skip it at once), or from pip's local wheel folders (PIP_FIND_LINKS) where a machine has them.
    local index=${COURSE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu} src=()
    if [ "$torch" = requirements/torch-cpu.txt ] &&
       "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$index/torch/" >/dev/null 2>&1; then
        src+=(--extra-index-url "$index")
    fi
    for dir in ${PIP_FIND_LINKS:-}; do src+=(--find-links "$dir"); done
    # The installer: uv (hash-locked in requirements/uv.txt) in .venv/uv/, put there by python3's own pip.
    # torch goes by its exact version (no hash: see requirements/torch-cpu.txt), the rest hash-checked; the
    # CUDA build (torch-cuda.txt) also brings the nvidia-* libraries it depends on.
    local deps=(--no-deps); [ "$torch" = requirements/torch-cuda.txt ] && deps=()
    if "$base" -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps --target .venv/uv \
            -r requirements/uv.txt >/dev/null 2>&1; then
        .venv/uv/bin/uv pip install --quiet --python "$py" --index-strategy unsafe-best-match \
            ${src[@]+"${src[@]}"} ${deps[@]+"${deps[@]}"} -r "$torch" -r requirements/cpu.txt
    else
        echo "check.sh：装不上 uv，改用 pip 安装同一个锁文件（慢一些）" >&2
        "$py" -m ensurepip --default-pip >/dev/null
        local pip=("$py" -m pip install --quiet --disable-pip-version-check)
        "${pip[@]}" ${src[@]+"${src[@]}"} ${deps[@]+"${deps[@]}"} -r "$torch"
        "${pip[@]}" --no-deps --require-hashes -r requirements/cpu.txt
    fi
    "$py" -c "$READY"
    stamp > .venv/.course-stamp
}

if [ -n "${COURSE_PYTHON:-}" ]; then
    PY=$COURSE_PYTHON
elif [ -x .venv/bin/python ] && [ "$(cat .venv/.course-stamp 2>/dev/null)" = "$(stamp)" ]; then
    PY=.venv/bin/python
elif [ -z "${COURSE_USE_VENV:-}" ] && command -v python3 >/dev/null 2>&1 && python3 -c "$READY" >/dev/null 2>&1; then
    PY=python3
else
    bootstrap_venv
    PY=.venv/bin/python
fi

export PYTHONDONTWRITEBYTECODE=1
exec "$PY" -m course "$@"
