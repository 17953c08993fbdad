#!/usr/bin/env bash
# The learner's entry point. First call: creates .venv and installs the pinned dependencies from
# pyproject.toml (CPU torch on machines without an NVIDIA GPU). Then: python -m course "$@".
#
# Which Python runs the course:
#   COURSE_PYTHON=/path/to/python   use exactly this interpreter (nothing is installed)
#   .venv/                          used once it has been set up by this script
#   the current python3             used when it already has everything (e.g. a GPU box without network)
#   COURSE_USE_VENV=1               skip that last detection and always set up .venv
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# Everything check.sh needs, importable and at the pinned transformers release.
READY='import sys
assert (3, 10) <= sys.version_info[:2] <= (3, 12), "Python 3.10-3.12 required"
import torch, transformers, numpy, triton, rich, pytest, pytest_timeout, safetensors, hypothesis
assert transformers.__version__ == "5.17.0", transformers.__version__'

stamp() { sha256sum pyproject.toml | cut -c1-16; }

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
    echo "首次运行：创建 .venv 并安装依赖（几分钟，只做一次）……" >&2
    rm -rf .venv
    "$base" -m venv .venv
    local pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        # No NVIDIA GPU: take torch's CPU build (about 200 MB) instead of the multi-GB CUDA build that
        # PyPI serves on Linux. 2.13 is the newest CPU release this course is tested with. The CPU index
        # is only added when it answers (offline mirrors and closed networks skip it at once).
        local index=${COURSE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu} extra=()
        if .venv/bin/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
                "$index/torch/" >/dev/null 2>&1; then
            extra=(--extra-index-url "$index")
        fi
        "${pip[@]}" "torch>=2.5,<2.14" ${extra[@]+"${extra[@]}"}
    fi
    local deps
    deps=$(.venv/bin/python - <<'PY'
import re
text = open("pyproject.toml", encoding="utf-8").read()
block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
print("\n".join(re.findall(r'"([^"]+)"', block)))
PY
)
    mapfile -t deps_array <<<"$deps"
    "${pip[@]}" "${deps_array[@]}"
    .venv/bin/python -c "$READY"
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
