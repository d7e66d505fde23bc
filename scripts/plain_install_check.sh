#!/usr/bin/env bash
# A plain install runs everything: in its own venv (.venv-plain), `pip install .` with no extras (what
# `pip install kvfleet` gives: no torch, transformers or peft) must run `kvfleet demo` and start
# `kvfleet controller` (gRPC health answers SERVING, then SIGTERM stops it cleanly). `./dev.sh test` runs it.
#
#   scripts/plain_install_check.sh          # uses (or builds) .venv-plain; prints each step's seconds
#
# Cost: the dependencies are installed only when pyproject.toml changed (stamp file, as dev.sh does for
# .venv); every run reinstalls the kvfleet package itself from this tree (a wheel build, --no-deps), so
# the check always reads today's code and package data, never an editable link to the source tree.
# Both installs build from a copy of what a source distribution holds (pyproject.toml, README.md and the
# three packages), never in the tree itself: setuptools writes build/ and kvfleet.egg-info where it builds,
# and dev.sh runs this check while it installs .venv (an editable install writing kvfleet.egg-info in the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv-plain
stamp=$VENV/.kvfleet-deps
t0=$SECONDS
step() { echo "== plain install: $* ($((SECONDS - t0)) s)"; }

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp pyproject.toml README.md "$src"/
tar -cf - --exclude=__pycache__ fleet workers controller | tar -xf - -C "$src"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  step "installing the dependencies of pyproject.toml (no extras)"
  rm -f "$stamp"
  "$VENV/bin/python" -m pip install -q 'setuptools>=68' "$src" > "$VENV/pip.log" 2>&1 \
    || { cat "$VENV/pip.log" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
step "reinstalling kvfleet from this tree"
"$VENV/bin/python" -m pip install -q --no-deps --force-reinstall --no-build-isolation "$src" > "$VENV/pip.log" 2>&1 \
  || { cat "$VENV/pip.log" >&2; exit 1; }

work=$(mktemp -d)
ctl_pid=
cleanup() {
  if [ -n "$ctl_pid" ] && kill -0 "$ctl_pid" 2>/dev/null; then kill -KILL "$ctl_pid" 2>/dev/null || true; fi
  rm -rf "$work" "$src"
}
trap cleanup EXIT
cd "$work"  # never the source tree: every import comes from the installed package

# The premise: none of the heavy optional packages is importable here.
"$VENV/bin/python" - <<'EOF'
import importlib.util, sys
found = [m for m in ("torch", "transformers", "peft") if importlib.util.find_spec(m) is not None]
if found:
    sys.exit(f"plain install check: {', '.join(found)} importable in .venv-plain; it must hold no extras")
import fleet
assert "site-packages" in fleet.__file__, f"fleet imported from {fleet.__file__}, not the installed package"
EOF

step "kvfleet demo"
"$VENV/bin/kvfleet" demo --agents 3 --turns 12 --workers 3 --no-peers --json > demo.json 2> demo.err \
  || { cat demo.err demo.json >&2; echo "plain install check: kvfleet demo failed" >&2; exit 1; }

step "kvfleet controller"
port=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$VENV/bin/kvfleet" controller --listen "127.0.0.1:$port" --store "sqlite:///$work/ctl.db" --metrics-port -1 \
  > ctl.log 2>&1 &
ctl_pid=$!
if ! "$VENV/bin/python" - "$port" "$ctl_pid" <<'EOF'
import os, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    stub = health_pb2_grpc.HealthStub(ch)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("the controller exited before it answered the health check")
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            sys.exit("no SERVING health answer within 120 s")
        time.sleep(0.5)
EOF
then
  cat ctl.log >&2; echo "plain install check: kvfleet controller did not start" >&2; exit 1
fi
grep -q "detector layers:" ctl.log || { cat ctl.log >&2; echo "plain install check: no detector layers line" >&2; exit 1; }
kill -TERM "$ctl_pid"
rc=0; wait "$ctl_pid" || rc=$?
ctl_pid=
if [ "$rc" != 0 ]; then
  cat ctl.log >&2; echo "plain install check: kvfleet controller stopped with exit code $rc" >&2; exit 1
fi
grep "detector layers:" ctl.log
# A layer named explicitly but not installed stays an error at start, naming the command that installs it.
rc=0; "$VENV/bin/kvfleet" controller --listen "127.0.0.1:$port" --store "sqlite:///$work/ctl2.db" --metrics-port -1 \
  --detector-layers encoder > named.log 2>&1 || rc=$?
if [ "$rc" != 2 ] || ! grep -q "pip install 'kvfleet\[encoder\]'" named.log; then
  cat named.log >&2; echo "plain install check: --detector-layers encoder without it installed: exit $rc, not a clear error" >&2; exit 1
fi
step "ok: kvfleet demo ran and kvfleet controller started and stopped, without torch, transformers or peft"
