"""Replay the Mooncake cell with AIPerf, the ecosystem's load generator, instead of this bench's own driver.

`bench/fleet_routing.py --driver aiperf` runs `aiperf profile --custom-dataset-type mooncake_trace
--fixed-schedule` (PyPI `aiperf`, kept in its own virtualenv: `--aiperf PATH` names its executable) against
each contender's URL, on the same stand-ins and with the same lifecycle hazards: the bench counts the trace's
requests as issued on its schedule, from the moment the first one reaches a worker, and fires the sleep, the
wake and the reset at the same fractions as its own driver does. What AIPerf sends is its own: it builds each
hash id's block from its Shakespeare corpus, so the prompts differ from the bench driver's, but two requests
share exactly the blocks their hash ids share, as in the trace.

The trace is scaled as the bench's mooncake workload is (bench/mooncake.py): 16 stand-in tokens per 512-token
block (`--isl-block-size 16`), time 10x faster, max_tokens 16. AIPerf needs a Hugging Face tokenizer to build
its prompts; none is downloadable here, so the bench writes one: a word-level vocabulary over AIPerf's corpus,
split as the stand-in splits text (one token per word), without BOS/EOS (AIPerf would put one between blocks),
saved as a local Hugging Face cache entry (AIPerf 0.13's worker processes load tokenizers in offline mode,
which takes a cached repo name, not a directory path).

What it cannot give: kvfleet's verdict headers (so no stale-warm-route count for runs it drives), and the
bench's per-request issue order (records are AIPerf's per-request export, in its session order).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = "kvfleet/sim-words"  # the tokenizer's name in the private Hugging Face cache the bench writes
_SNAPSHOT = "0" * 40
_BUILD = r"""
import pathlib, re, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, Regex
from transformers import PreTrainedTokenizerFast
import aiperf
corpus = (pathlib.Path(aiperf.__file__).parent / "dataset/generator/assets/shakespeare.txt").read_text()
vocab = {"[UNK]": 0}
for w in sorted(set(re.findall(r"\w+|[^\w\s]", corpus))):
    vocab.setdefault(w, len(vocab))
tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "removed"),
                                            pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), "isolated")])
tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(sys.argv[1])
"""


def aiperf_python(aiperf: str) -> str:
    """The interpreter of the virtualenv the aiperf executable belongs to."""
    exe = shutil.which(aiperf) or aiperf
    py = Path(exe).resolve().parent / "python"
    if not py.exists():
        raise SystemExit(f"--aiperf {aiperf}: no python beside it ({py}); give the aiperf of a virtualenv")
    return str(py)


def prepare(aiperf: str, workdir: Path) -> tuple[dict[str, str], str]:
    """Write the tokenizer into a private Hugging Face cache under `workdir`; the env AIPerf runs with, its version."""
    home = workdir / "hf"
    snap = home / "hub" / ("models--" + REPO.replace("/", "--")) / "snapshots" / _SNAPSHOT
    if not (snap / "tokenizer.json").exists():
        snap.mkdir(parents=True, exist_ok=True)
        (snap.parent.parent / "refs").mkdir(exist_ok=True)
        (snap.parent.parent / "refs" / "main").write_text(_SNAPSHOT)
        built = subprocess.run([aiperf_python(aiperf), "-c", _BUILD, str(snap)], capture_output=True, text=True)
        if built.returncode:  # NOTE: its stderr said why (an aiperf venv missing a package); a bare exit code did not
            raise SystemExit(f"--aiperf {aiperf}: writing the tokenizer failed (exit {built.returncode}): "
                             f"{built.stderr.strip()[-1500:]}")
    version = subprocess.run([aiperf_python(aiperf), "-c", "from importlib.metadata import version as v; "
                              "print(v('aiperf'))"], capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env, version


def write_trace(rows: list[dict[str, Any]], path: Path, max_tokens: int) -> None:
    """The trace as bench/mooncake.py scales it: prompt lengths in stand-in tokens, timestamps 10x faster."""
    from mooncake import TIME_SCALE, TOKENS_PER_BLOCK, TRACE_BLOCK

    t0 = float(rows[0]["timestamp"])
    with path.open("w") as f:
        for r in rows:
            n = max(1, math.ceil(int(r["input_length"]) * TOKENS_PER_BLOCK / TRACE_BLOCK))
            f.write(json.dumps({"timestamp": round((float(r["timestamp"]) - t0) / TIME_SCALE, 3),
                                "input_length": n, "output_length": max_tokens,
                                "hash_ids": r["hash_ids"]}) + "\n")


def command(aiperf: str, url: str, model: str, trace: Path, out: Path, headers: dict[str, str], seed: int,
            timeout_s: float) -> list[str]:
    from mooncake import TOKENS_PER_BLOCK

    cmd = [aiperf, "profile", "--model", model, "--tokenizer", REPO, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--custom-dataset-type", "mooncake_trace", "--input-file", str(trace),
           "--fixed-schedule", "--isl-block-size", str(TOKENS_PER_BLOCK), "--ui", "none",
           "--output-artifact-dir", str(out), "--random-seed", str(seed),
           "--request-timeout-seconds", str(timeout_s)]
    for k, v in headers.items():
        cmd += ["--header", f"{k}:{v}"]
    return cmd


# NOTE: AIPerf's error types for a request its --request-timeout-seconds (the bench's --timeout) cut: aiohttp's total
# timeout raises TimeoutError (no code), and a request never sent within it is RequestSendTimeout (code 0). They were
# read as failures (status -1), so the report neither counted them timed out nor put them in the TTFT percentiles at
# the timeout, as it does for the bench's own driver: a contender whose requests timed out got a better TTFT tail
TIMEOUT_ERRORS = ("TimeoutError", "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError",
                  "RequestSendTimeout")


def timed_out(err: Any) -> bool:
    """Whether AIPerf's error for a request says the client timeout cut it (the bench's status 0)."""
    return isinstance(err, dict) and err.get("type") in TIMEOUT_ERRORS


def records(export: Path, name: str) -> tuple[list[dict[str, Any]], float]:
    """AIPerf's per-request export as the bench's Record fields, and the wall time from first send to last end."""
    out, starts, ends = [], [], []
    for line in export.read_text().splitlines():
        d = json.loads(line)
        md, m = d.get("metadata", {}), d.get("metrics", {})

        def val(k: str, m: dict[str, Any] = m) -> Any:
            x = m.get(k)
            return x.get("value") if isinstance(x, dict) else None

        err = d.get("error")
        i = int(md.get("session_num", len(out)))
        starts.append(md.get("request_start_ns", 0))
        ends.append(md.get("request_end_ns", 0))
        ttft = val("time_to_first_token")
        lat = val("request_latency")
        cut = timed_out(err)
        status = 200 if not err else 0 if cut else int(err.get("code") or -1) if isinstance(err, dict) else -1
        out.append({
            "session": f"{name}-r{i}", "turn": 0, "status": status,
            "ttft_s": ttft / 1000 if ttft is not None and (not err or cut) else None,
            "total_s": lat / 1000 if lat is not None else None,
            "prompt_tokens": val("usage_prompt_tokens"), "cached_tokens": val("usage_prompt_cache_read_tokens"),
            "verdict": None, "matched_tokens": 0, "attempts": 1,
            "error": "" if not err else json.dumps(err)[:200], "issued": i + 1,
            "finish_reason": None if err else "length", "worker": None,
        })
    wall = (max(ends) - min(starts)) / 1e9 if starts else 0.0
    out.sort(key=lambda r: r["issued"])
    return out, wall


@dataclass(frozen=True, slots=True)
class Ran:
    records: list[dict[str, Any]]  # the bench's Record fields
    wall_s: float
    version: str
    command: list[str]


async def drive(driver: Any, aiperf: str, workdir: Path, rows: list[dict[str, Any]], model: str,
                max_tokens: int) -> Ran:
    """Run AIPerf against `driver.run` while `driver` follows the trace's schedule (Driver.follow in
    bench/fleet_routing.py: its lifecycle actions fire as under the bench's own driver)."""
    env, version = prepare(aiperf, workdir.parent)
    trace, out, log_path = workdir / "trace.jsonl", workdir / "aiperf", workdir / "aiperf.log"
    write_trace(rows, trace, max_tokens)
    headers = driver.run.headers(driver.wl.tenants[0])
    cmd = command(aiperf, driver.run.url, model, trace, out, headers, driver.opt.seed, driver.opt.timeout_s)
    with log_path.open("w") as log:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            await driver.follow(proc.wait())
        finally:
            if proc.returncode is None:
                proc.kill()
    export = out / "profile_export.jsonl"
    if proc.returncode != 0 or not export.exists():
        from peers.launch import Unavailable  # the bench reports the contender unavailable, and goes on

        raise Unavailable(f"aiperf exited {proc.returncode} (its log: {log_path}): {log_path.read_text()[-2000:]}")
    recs, wall = records(export, driver.wl.name)
    return Ran(recs, wall, version, cmd)
