"""`kvfleet` console entry point: one subcommand per module in fleet/app/cli (or controller/)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fleet.app.cli.sigint import sigint_as_interrupt

# subcommand -> "module:function" taking (argv: list[str]) -> int. Modules are imported lazily so
# that `kvfleet witness` never pays for grpc/ray imports and vice versa.
COMMANDS: dict[str, tuple[str, str]] = {
    "witness": ("fleet.app.cli.witness:main", "run the kernel exactness checks live and print the table"),
    "controller": ("controller.main:main", "run the gRPC controller"),
    "sim-vllm": ("fleet.app.testkit.sim_vllm.main:main", "run a vLLM stand-in that speaks vLLM's protocol"),
    "proxy": ("controller.proxy.main:main", "OpenAI-compatible routing proxy in front of vLLM workers"),
    "up": ("fleet.app.cli.up:main", "controller + local Ray + embedded store in one command"),
    "demo": ("fleet.app.cli.demo:main", "the main job: an agent fleet workload on one machine"),
    "session": ("fleet.app.cli.session:main", "session ls --fleet: the fleet dashboard"),
    "worker": ("fleet.app.cli.worker:main", "worker ls: vLLM workers and kernel nodes"),
    "quarantine": ("fleet.app.cli.quarantine:main", "quarantine ls: tool results the proxy withheld; set: a verdict"),
}
# Ctrl-C's exit status: 128 + SIGINT, as a shell reports a command SIGINT ended. NOTE: a one-shot listing exited 0
# on Ctrl-C, as if it had been shown (found by review); Ctrl-C is how --watch ends, a normal end there (ls_modes.watch)
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand; its output piped into a reader that stops early (`| head`) ends it quietly, exit 1.

    NOTE: it printed a BrokenPipeError traceback (`kvfleet worker ls --json | head -c 600`, `kvfleet sim-vllm |
    head -1`; found by a new user's run). Output still buffered is flushed here, so a closed pipe fails here rather
    than at the interpreter's exit; the rest goes to /dev/null, as Python's documentation of SIGPIPE advises."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(prog="kvfleet", description="kvfleet: the KV-cache layer for LLM agent fleets")
        p.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
        if not argv:  # NOTE: no command printed the help and exited 0, as if something had run (found by review)
            p.print_help(sys.stderr)
            return 2
        p.parse_args(argv[:1])
        return 2
    target, _ = COMMANDS[argv[0]]
    mod_name, fn_name = target.split(":")
    try:
        with sigint_as_interrupt():  # the command's modules load (not its run: asyncio.run handles Ctrl-C there)
            try:
                mod = importlib.import_module(mod_name)
            except ModuleNotFoundError as e:
                if e.name and (e.name == mod_name or mod_name.startswith(e.name + ".")):
                    print(f"kvfleet {argv[0]}: not available in this build ({e})", file=sys.stderr)
                    return 2
                raise
        rc = getattr(mod, fn_name)(argv[1:])
    except KeyboardInterrupt:  # NOTE: was Python's traceback, deep in torch (`kvfleet witness`; found by review), and
        # while the command's modules loaded, which this handler did not cover
        print(f"kvfleet {argv[0]}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
