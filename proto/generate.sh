#!/usr/bin/env bash
# Regenerate the committed Python stubs (with .pyi) from proto/spotdrain/v1/*.proto.
#   proto/generate.sh          rewrite the stubs
#   proto/generate.sh --check  fail if the committed stubs differ from what the protos give
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$here/../.venv/bin/python}
out=$here
export PATH="$(dirname "$py"):$PATH"  # protoc-gen-mypy_grpc lives beside the interpreter
if [[ "${1:-}" == "--check" ]]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
"$py" -m grpc_tools.protoc -I "$here" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    --mypy_grpc_out="$out" \
    "$here"/spotdrain/v1/*.proto
if [[ "${1:-}" == "--check" ]]; then
    for f in "$out"/spotdrain/v1/*.py "$out"/spotdrain/v1/*.pyi; do
        rel=spotdrain/v1/$(basename "$f")
        if ! cmp -s "$f" "$here/$rel"; then
            echo "proto stubs drifted: $rel differs from what proto/generate.sh makes" >&2
            exit 1
        fi
    done
    echo "proto stubs match"
fi
