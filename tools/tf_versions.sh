#!/usr/bin/env bash
# One fastxfer wheel against several TensorFlow releases (docs/packaging.md): for each version a fresh
# venv with the wheel, tensorflow==VERSION (and the Keras it accepts), pytest and mlxtend; then the
# native-op tests and a 2-rank Keras fit (tools/tf_fit_check.py). Prints a markdown table.
# Usage: tools/tf_versions.sh WHEEL [VERSION ...]   (default versions: 2.16.2 2.18.1 2.20.0 2.21.0)
set -uo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; shift
versions=("$@"); [ ${#versions[@]} -gt 0 ] || versions=(2.16.2 2.18.1 2.20.0 2.21.0)
work="$(mktemp -d "${TMPDIR:-/tmp}/fastxfer-tf.XXXXXX")"  # logs stay there; each venv goes when checked
echo "logs in $work" >&2
rows=()
for v in "${versions[@]}"; do
  env="$work/tf-$v"
  echo "== TensorFlow $v in $env" >&2
  python3 -m venv "$env"
  if ! "$env/bin/pip" install -q "$wheel" "tensorflow==$v" pytest mlxtend >"$env.install.log" 2>&1; then
    rows+=("| $v | - | install failed: $(tail -1 "$env.install.log") | - |"); continue
  fi
  keras_v="$("$env/bin/python" -c 'import importlib.metadata as m; print(m.version("keras"))' 2>/dev/null)"
  # the checkout's tests against the installed wheel (--import-mode=importlib: never the source tree)
  (cd "$src" && TF_CPP_MIN_LOG_LEVEL=3 "$env/bin/python" -m pytest -q -p no:cacheprovider \
      tests/multiproc/test_tf_native.py >"$env.tests.log" 2>&1)
  tests="$(grep -Eo '[0-9]+ (passed|failed|error)[^=]*' "$env.tests.log" | tail -1)"
  fit="$(cd "$work" && TF_CPP_MIN_LOG_LEVEL=3 "$env/bin/python" -m fastxfer.cli run -np 2 -- \
      "$env/bin/python" "$src/tools/tf_fit_check.py" 2>&1 | grep -Eo 'fit ok.*|Error.*' | tail -1)"
  rows+=("| $v | ${keras_v:--} | ${tests:-no result (see $env.tests.log)} | ${fit:-failed} |")
  rm -rf "$env"  # a TensorFlow install is about 1.5 GB
done
echo "| TensorFlow | Keras | native-op tests (tests/multiproc/test_tf_native.py) | 2-rank Keras fit |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
