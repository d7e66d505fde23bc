"""Proxy load test on loopback: added latency and requests/s against sending straight to the workers.

Separate processes, as deployed: 2 `kvfleet sim-vllm` workers (clock off, `--time-scale 0`: the proxy's own
cost is what is measured), `kvfleet controller` (auth on, SQLite store), `kvfleet proxy` (and a second one
with a local tokenizer, `--tokenizer hf:PATH`, when transformers is installed); this script is the load
generator. Each of C concurrent clients holds one conversation and sends R streaming chat turns one after
another (each turn appends a record of the answer and a new user message, so the prefix grows and the
router sees it warm). Every round's conversations are new (never in the proxy's tokenize cache). The paths
(straight to a worker, the client's own, round robin; through each proxy; through each peer router that is
installed, launched as bench/fleet_routing.py launches it: vllm-router kv_aware with the stand-ins' KV
events, sglang-router cache_aware) run in interleaved rounds, each first in turn, so all see the same
machine. Bounded: C*R requests per round, and a round stops early after --round-timeout seconds
(unfinished requests are counted, not hidden).

    python bench/proxy_load.py                       # 200 clients x 5 turns, 4 rounds per path
    python bench/proxy_load.py --clients 250 --turns 4 --no-docs
    git worktree add ../before HEAD~1 && python bench/proxy_load.py --baseline-tree ../before --solo-only
        # also a proxy from another source tree (path "proxy-baseline"), in the same rounds: before/after

Latency = time to the first SSE event (TTFB) and to the end of the stream, at the client.
CPU per request = the router process's CPU time (user + system, all its threads, from /proc) over its rounds,
divided by the requests answered, and the controller's over the same rounds (it serves only the kvfleet paths: in
the other rows its figure is what it spends on KV events and polls alone).
Added latency = proxy percentile minus direct percentile (same percentile, same run).
In the 1-client rounds the load generator also times the proxy's two extra hops alone (path "hops": the same
turns' /tokenize to a worker, then a tracked Route to the controller with the client's token, released after,
untimed), so the report can say how much of what the proxy adds is those round trips and how much its own work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp

from controller.auth import mint_token
from controller.proxy.control import ControlClient
from controller.proxy.tokenize import tokenize_request
from fleet.app.redis_server import free_port
from fleet.sdk import AsyncFleetClient

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/peers: the peers as fleet_routing launches them
from peers import launch as peers  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MODEL = "sim-model"
SYSTEM = "You are the planning agent of a logistics fleet. Answer tersely, with numbers. " * 6


@dataclass(slots=True)
class Sample:
    ttfb: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    errors: int = 0
    unfinished: int = 0
    warm: int = 0
    wall: float = 0.0
    cpu: float = 0.0  # the router process's CPU seconds over the round (0: no router on the path)
    ctl_cpu: float = 0.0  # the controller's


@dataclass(slots=True)
class Hops:
    """Round trips of the proxy's two extra hops, timed from the load generator (seconds)."""

    tokenize: list[float] = field(default_factory=list)
    route: list[float] = field(default_factory=list)
    both: list[float] = field(default_factory=list)


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system, every thread), in seconds."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # from the state on (the name may hold spaces)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def spawn(args: list[str], log: pathlib.Path, tree: pathlib.Path | None = None) -> subprocess.Popen[str]:
    """`kvfleet ARGS` in a new process; from the source tree `tree` instead of this one when given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": str(tree)} if tree else {})}
    return subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True, env=env, cwd=tree)


def tree_label(tree: pathlib.Path) -> str:
    """The baseline tree's commit (short hash), as the report names it."""
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown commit"


def first_line(p: subprocess.Popen[str], what: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited before it printed its endpoint (see its log)")
    return line


async def one_client(http: aiohttp.ClientSession, url: str, headers: dict[str, str], cid: int, turns: int,
                     out: Sample, deadline: float, tag: str) -> None:
    # NOTE: `tag` makes each round's conversations new: a repeated one would hit the proxy's tokenize cache on
    # every turn (a real new turn never does) and hide the tokenize hop
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Client {cid} ({tag}): route truck {cid}."}]
    for turn in range(turns):
        if time.perf_counter() > deadline:
            out.unfinished += turns - turn
            return
        body = {"model": MODEL, "messages": msgs, "max_tokens": 16, "stream": True}
        t0 = time.perf_counter()
        try:
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.content.readuntil(b"\n\n")
                t1 = time.perf_counter()
                rest = await r.read()
                if r.status != 200 or not rest.endswith(b"data: [DONE]\n\n"):
                    out.errors += 1
                    continue
                out.warm += r.headers.get("x-kvfleet-verdict") == "WARM"
        except (aiohttp.ClientError, TimeoutError):
            out.errors += 1
            continue
        out.ttfb.append(t1 - t0)
        out.total.append(time.perf_counter() - t0)
        # NOTE: the client's record of the answer is a fixed text (as an agent that keeps its own summary): every
        # word the bench sends is then one the local tokenizer knows (see local_tokenizer)
        msgs = msgs + [{"role": "assistant", "content": f"Routed truck {cid}, turn {turn}."},
                       {"role": "user", "content": f"Then stop {turn}?"}]


async def hop_round(url: str, ctl: ControlClient, token: str, turns: int, tag: str, out: Hops) -> None:
    """One conversation as one_client holds it (client 0), each turn's two proxy hops alone: the /tokenize body
    the proxy would send, to a worker; then Route (tracked, as the proxy routes) with the ids it got."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Client 0 ({tag}): route truck 0."}]
    async with aiohttp.ClientSession() as http:
        for turn in range(turns):
            body = {"model": MODEL, "messages": msgs, "max_tokens": 16, "stream": True}
            data = json.dumps(tokenize_request(body, chat=True)).encode()
            t0 = time.perf_counter()
            async with http.post(url + "/tokenize", data=data, headers={"Content-Type": "application/json"}) as r:
                ids = (await r.json())["tokens"]
            t1 = time.perf_counter()
            d = await ctl.route(ids, MODEL, lora=None, token=token)
            t2 = time.perf_counter()
            await ctl.release(d.route_id, token)
            out.tokenize.append(t1 - t0)
            out.route.append(t2 - t1)
            out.both.append(t2 - t0)
            msgs = msgs + [{"role": "assistant", "content": f"Routed truck 0, turn {turn}."},
                           {"role": "user", "content": f"Then stop {turn}?"}]


async def round_(urls: list[str], headers: dict[str, str], clients: int, turns: int, timeout: float,
                 tag: str) -> Sample:
    out = Sample()
    deadline = time.perf_counter() + timeout
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(http, urls[c % len(urls)], headers, c, turns, out, deadline, tag)
                               for c in range(clients)))
        out.wall = time.perf_counter() - t0
    return out


def merge(samples: list[Sample]) -> Sample:
    m = Sample()
    for s in samples:
        m.ttfb += s.ttfb
        m.total += s.total
        m.errors += s.errors
        m.unfinished += s.unfinished
        m.warm += s.warm
        m.wall += s.wall
        m.cpu += s.cpu
        m.ctl_cpu += s.ctl_cpu
    return m


def local_tokenizer(path: pathlib.Path, max_number: int) -> pathlib.Path | None:
    """A Hugging Face tokenizer giving the stand-in's own ids on every text this bench sends (its words, numbers
    up to `max_number`, the proxy's parity probes), saved at `path`; None without the `tokenizers` and
    `transformers` packages, or if two of those words share an id. The
    stand-in's ids are crc32 hashes of words, so a word-level vocabulary over the bench's known words reproduces
    them (and a ChatML-shaped template its chat format)."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    from controller.proxy.tokenize import PROBES
    from fleet.app.testkit.sim_vllm import tokenizer as simtok

    texts = [SYSTEM, "Client route truck Routed turn Then stop system user assistant direct proxy local warm up",
             "( ) / : ? - . ,", *(json.dumps(p) for p in PROBES)]
    words = set(simtok._WORD.findall(" ".join(texts))) | {str(i) for i in range(max_number + 1)}
    vocab = {w: 100 + zlib.crc32(w.encode()) % simtok.VOCAB for w in words}
    if len(set(vocab.values())) < len(vocab):  # a saved word-level vocabulary keeps one word per id
        print("two of the bench's words share a stand-in id, which a saved word-level vocabulary cannot hold: "
              "no local-tokenizer path this run", file=sys.stderr)
        return None
    vocab.update({"[UNK]": 0, "\n": simtok.NEWLINE, "<|im_start|>": simtok.IM_START, "<|im_end|>": simtok.IM_END})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"[ \t]+"), "removed"),
                                                pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\n"), "isolated")])
    tk.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    return path


async def run(a: argparse.Namespace, tmp: pathlib.Path) -> tuple[dict[tuple[int, str], Sample], Hops]:
    procs: list[subprocess.Popen[str]] = []
    ctl_client: ControlClient | None = None
    try:
        sims = []
        for i in range(a.workers):
            procs.append(spawn(["sim-vllm", "--model", MODEL, "--num-blocks", "65536", "--time-scale", "0"],
                               tmp / f"sim{i}.log"))
            sims.append(json.loads(first_line(procs[-1], "sim-vllm")))
        tokens = tmp / "tokens.json"
        op, tenant = mint_token(tokens, "ops", "operator"), mint_token(tokens, "acme", "tenant")
        ctl = f"127.0.0.1:{free_port()}"
        procs.append(spawn(["controller", "--listen", ctl, "--store", f"sqlite:///{tmp / 'kv.db'}",
                            "--tokens-file", str(tokens), "--metrics-port", "-1"], tmp / "controller.log"))
        first_line(procs[-1], "controller")
        ctl_pid = procs[-1].pid
        pids: dict[str, int] = {}  # the process serving each routed path
        async with AsyncFleetClient(ctl, token=op) as c:
            for i, s in enumerate(sims):
                await c.register_worker(f"w{i}", url=s["url"], kv_events=s["kv_events"], replay=s["replay"] or "",
                                        model=MODEL)
        auth = {"Authorization": f"Bearer {tenant}"}
        paths: dict[str, tuple[list[str], dict[str, str]]] = {"direct": ([s["url"] for s in sims], {})}
        tok = None if a.no_local_tokenizer else local_tokenizer(
            tmp / "tokenizer", max(a.clients, a.turns, a.solo_turns, a.rounds))
        proxies: list[tuple[str, list[str], pathlib.Path | None]] = [("proxy", [], None)]
        if a.baseline_tree:
            proxies.append(("proxy-baseline", [], a.baseline_tree))
        if tok:
            proxies.append(("proxy-local", ["--tokenizer", f"hf:{tok}"], None))
        for mode, extra, tree in proxies:
            listen = f"127.0.0.1:{free_port()}"
            procs.append(spawn(["proxy", "--controller", ctl, "--listen", listen, "--token", op, *extra],
                               tmp / f"{mode}.log", tree))
            first_line(procs[-1], mode)
            pids[mode] = procs[-1].pid
            paths[mode] = ([f"http://{listen}"], auth)
            await round_(paths[mode][0], auth, 8, 2, 30, f"warm-up {mode}")  # connections, workers seen serving
        if "proxy-local" in paths:
            await check_parity(paths["proxy-local"][0][0])
        await start_peers(a.peers, sims, tmp, procs, paths, pids)
        res: dict[tuple[int, str], list[Sample]] = {}
        hops = Hops()
        ctl_client = ControlClient(ctl)
        for clients, turns in ((1, a.solo_turns), *(() if a.solo_only else ((a.clients, a.turns),))):
            modes = [*paths, "hops"] if clients == 1 else list(paths)
            for r in range(a.rounds):
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # each path first in turn
                    if mode == "hops":
                        await hop_round(sims[0]["url"], ctl_client, tenant, turns, f"hops/{r}", hops)
                        continue
                    urls, hdr = paths[mode]
                    pid = pids.get(mode)
                    cpu0, ctl0 = (cpu_s(pid) if pid else 0.0), cpu_s(ctl_pid)
                    s = await round_(urls, hdr, clients, turns, a.round_timeout, f"{clients}/{r}/{mode}")
                    s.cpu, s.ctl_cpu = (cpu_s(pid) - cpu0 if pid else 0.0), cpu_s(ctl_pid) - ctl0
                    print(f"{clients} clients round {r} {mode:11s}: {len(s.total)} ok, {s.errors} errors, "
                          f"{s.unfinished} unfinished, {len(s.total) / s.wall:.0f} req/s, TTFB p50 "
                          f"{1e3 * pct(s.ttfb, 50):.1f} ms p99 {1e3 * pct(s.ttfb, 99):.1f} ms, CPU ms/request: "
                          f"router {_per(s.cpu, s)}, controller {_per(s.ctl_cpu, s)}", flush=True)
                    res.setdefault((clients, mode), []).append(s)
        return {k: merge(v) for k, v in res.items()}, hops
    finally:
        if ctl_client is not None:
            await ctl_client.close()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


class StandIns(SimpleNamespace):
    """The stand-in processes as `peers.launch.peer_command` reads a fleet: urls(), block_size, sims."""

    def urls(self) -> list[str]:
        return [s.url for s in self.sims.values()]


async def start_peers(names: list[str], sims: list[dict[str, object]], tmp: pathlib.Path,
                      procs: list[subprocess.Popen[str]], paths: dict[str, tuple[list[str], dict[str, str]]],
                      pids: dict[str, int]) -> None:
    """Each peer router of `names` in front of the stand-ins, as a path of its own; one not installed, or not
    answering its /health, is left out with a line saying so (the report then has no row for it)."""
    fleet = StandIns(sims={f"w{i}": SimpleNamespace(**s) for i, s in enumerate(sims)},
                      block_size=int(sims[0]["block_size"]))
    for name in names:
        try:
            cmd = peers.peer_command(peers.CONTENDERS[name], fleet)
        except peers.Unavailable as e:
            print(f"{name}: left out: {e}", file=sys.stderr)
            continue
        p = peers.spawn(cmd, tmp / f"{name}.log")
        procs.append(p)
        url = f"http://127.0.0.1:{peers.port_of(cmd)}"
        try:
            async with aiohttp.ClientSession() as http:
                await peers.until_http(http, url + "/health", [p])
        except peers.Unavailable as e:
            print(f"{name}: left out: {e}; log: {(tmp / f'{name}.log').read_text(errors='replace')[-600:]}",
                  file=sys.stderr)
            continue
        paths[name], pids[name] = ([url], {}), p.pid
        await round_([url], {}, 8, 2, 30, f"warm-up {name}")


async def check_parity(url: str) -> None:
    """The local-tokenizer proxy passed its parity probes (else it would use the workers' /tokenize and the
    row would measure the wrong thing)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
        parity = (await r.json())["tokenizer"]["parity"]
    if parity.get(MODEL) is not True:
        raise RuntimeError(f"the local tokenizer failed the proxy's parity check ({parity}); see proxy-local.log")


def _per(cpu: float, s: Sample) -> str:
    """CPU milliseconds per answered request ("-" where the path has no router)."""
    return f"{1e3 * cpu / len(s.total):.2f}" if cpu and s.total else "-"


def _row(name: str, s: Sample, ctl: bool = False) -> str:
    return (f"| {name} | {len(s.total)} | {s.errors} | {s.unfinished} | {len(s.total) / s.wall:.0f} | "
            f"{1e3 * pct(s.ttfb, 50):.1f} | {1e3 * pct(s.ttfb, 99):.1f} | {1e3 * pct(s.total, 50):.1f} | "
            f"{1e3 * pct(s.total, 99):.1f} | {_per(s.cpu, s)} | {_per(s.ctl_cpu, s) if ctl else '-'} |")


def _added(name: str, d: Sample, p: Sample) -> str:
    ms = [1e3 * (pct(p.ttfb, q) - pct(d.ttfb, q)) for q in (50, 99)]
    ms += [1e3 * (pct(p.total, q) - pct(d.total, q)) for q in (50, 99)]
    ratio = (len(p.total) / p.wall) / (len(d.total) / d.wall)
    return (f"| **{name}** | | | | {ratio:.2f}x | **{ms[0]:+.1f}** | **{ms[1]:+.1f}** | {ms[2]:+.1f} | "
            f"{ms[3]:+.1f} | | |")


PEERS = ("vllm-kv_aware", "sglang-cache_aware")  # the peers users would pick instead (bench/peers/launch.py)
PATHS = {"direct": "straight to the worker", "proxy": "through the proxy (workers' /tokenize, the default)",
         "vllm-kv_aware": "through vllm-router kv_aware (KV events), the peer",
         "sglang-cache_aware": "through sglang-router cache_aware, the peer",
         "proxy-baseline": "through the baseline proxy ({label}, workers' /tokenize)",
         "proxy-local": "through the proxy, local tokenizer (`--tokenizer hf:PATH`)"}
ADDED = {"proxy": "added by the proxy", "proxy-baseline": "added by the baseline proxy ({label})",
         "vllm-kv_aware": "added by vllm-router kv_aware", "sglang-cache_aware": "added by sglang-router cache_aware",
         "proxy-local": "added by the proxy, local tokenizer"}


def hops_note(h: Hops, d: Sample, p: Sample) -> str:
    """What the two extra hops alone take, against what the proxy adds at 1 client."""
    if not h.both:
        return ""
    ms = {k: [1e3 * pct(xs, q) for q in (50, 99)] for k, xs in (("tok", h.tokenize), ("route", h.route),
                                                                 ("both", h.both))}
    added = [1e3 * (pct(p.ttfb, q) - pct(d.ttfb, q)) for q in (50, 99)]
    return (f"The proxy's two extra hops alone, timed from the load generator in the same 1-client rounds "
            f"({len(h.both)} turns of the same conversations: the /tokenize body the proxy sends, to a worker; then "
            "a tracked Route with the client's token, released after, untimed): /tokenize p50 "
            f"{ms['tok'][0]:.1f} ms, p99 {ms['tok'][1]:.1f} ms; Route p50 {ms['route'][0]:.1f} ms, p99 "
            f"{ms['route'][1]:.1f} ms; the two in turn p50 {ms['both'][0]:.1f} ms, p99 {ms['both'][1]:.1f} ms, "
            f"against the proxy's added {added[0]:+.1f} ms at p50 and {added[1]:+.1f} ms at p99. The rest, "
            f"{added[0] - ms['both'][0]:.1f} ms at p50, is the proxy's own work (reading and checking the request, "
            "the forward, the relay) and its extra loopback hop (client to proxy to worker, not client to worker).")


def report(res: dict[tuple[int, str], Sample], a: argparse.Namespace, load: tuple[float, float],
           hops: Hops | None = None) -> str:
    rows = ["| clients, path | requests ok | errors | unfinished | req/s | TTFB p50 ms | TTFB p99 ms | "
            "stream p50 ms | stream p99 ms | router CPU ms/req | controller CPU ms/req |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    label = tree_label(a.baseline_tree) if a.baseline_tree else ""
    modes = [m for m in ("proxy", "proxy-baseline", "proxy-local", *PEERS) if (1, m) in res]
    local = "proxy-local" in modes
    for clients in (1,) if a.solo_only else (1, a.clients):
        d = res[(clients, "direct")]
        rows.append(_row(f"{clients}, {PATHS['direct']}", d))
        for mode in modes:
            p = res[(clients, mode)]
            rows += [_row(f"{clients}, {PATHS[mode].format(label=label)}", p, ctl=mode.startswith("proxy")),
                     _added(ADDED[mode].format(label=label), d, p)]
    p = res[(1 if a.solo_only else a.clients, "proxy")]
    return "\n".join([
        "## Proxy: added latency and throughput (`python bench/proxy_load.py`)",
        "",
        ("" if a.solo_only else f"{a.clients} concurrent streaming clients (and, for the unloaded cost, 1 client), "
         f"each holding one conversation of {a.turns} chat turns ({a.solo_turns} for the single client), ")
        + (f"1 streaming client holding one conversation of {a.solo_turns} chat turns, " if a.solo_only else "")
        + f"16 tokens streamed per turn; {a.rounds} rounds per path, the paths interleaved (each first in turn); "
        "every round's conversations are new, so no turn hits the proxy's tokenize cache; "
        f"{a.workers} `kvfleet sim-vllm` workers (clock off: they answer at once), `kvfleet controller` (auth on) "
        "and `kvfleet proxy` as separate processes on loopback, with the load "
        f"generator, on this machine's {os.cpu_count()} cores (shared with other work; load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end). Per request the proxy "
        "does: WhoAmI (cached 5 s), the worker's /tokenize (chat template), one Route (a message on its "
        "RouteStream to the controller), then relays the stream, and releases the route after it (off the answer's "
        "path); straight-to-worker requests skip all of it. The controller and the proxy run on uvloop "
        "(KVFLEET_EVENT_LOOP, fleet/core/event_loop.py). "
        + (f"The baseline proxy runs the same flags from the source tree of commit {label}, in the same rounds, "
           "against the same controller (it routes with unary calls if it predates RouteStream). "
           if label else "")
        + ("The local-tokenizer proxy loads a word-level Hugging Face tokenizer built to give the stand-in's own "
           "ids (it passed the proxy's parity probes), so it skips the /tokenize hop as `--tokenizer hf:PATH` does "
           "in front of a real vLLM. " if local else "")
        + (f"The peer routers ({', '.join(m for m in modes if m in PEERS)}) are launched as `bench/fleet_routing.py` "
           "launches them, in front of the same stand-ins (vllm-router kv_aware subscribed to their KV events), in "
           "the same rounds: what a user who picks one of them instead pays per request (what each does per request, "
           "and why sglang-router's first streamed event comes about 40 ms late here: docs/proxy.md). "
           if any(m in PEERS for m in modes) else "")
        + "Added = router percentile minus direct percentile (same percentile, same run). CPU per request: the "
        "router process's CPU time (user + system, all its threads) over its rounds per answered request, and the "
        "controller's over the same rounds (it serves only the kvfleet paths; beside a peer its figure is its KV "
        "events and polls alone, so it is not shown there).",
        "",
        *rows,
        "",
        *((hops_note(hops, res[(1, "direct")], res[(1, "proxy")]), "") if hops is not None and hops.both else ()),
        *(() if a.solo_only else (
            f"Under load, {p.warm} of {len(p.total)} proxied turns were routed WARM (later turns hold their "
            "conversation's prefix; first turns share the system prompt). The stand-in workers answer at once "
            "(no GPU), so the extra hops and their CPU are the whole difference; at "
            f"{a.clients} clients every process competes for the same {os.cpu_count()} cores, so that row is "
            "mostly queueing.",)),
    ])


def write_docs(section: str) -> None:
    from benchdoc import write_section

    write_section("proxy", section, DOCS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--solo-turns", type=int, default=30, help="turns of the single-client (unloaded) runs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--round-timeout", type=float, default=90.0)
    ap.add_argument("--no-local-tokenizer", action="store_true",
                    help="skip the path through a proxy with a local tokenizer (needs transformers and tokenizers)")
    ap.add_argument("--baseline-tree", type=pathlib.Path, default=None,
                    help="also run a proxy from this source tree (e.g. a git worktree of an earlier commit) in the "
                         "same rounds, path proxy-baseline: before and after side by side")
    ap.add_argument("--solo-only", action="store_true",
                    help="only the 1-client rounds (the unloaded added latency); the docs are not written")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="comma-separated peer routers to run as paths of their own (installed ones; '' for none): "
                         + ", ".join(PEERS))
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    a.peers = [x for x in a.peers.split(",") if x]
    if bad := [x for x in a.peers if x not in PEERS]:
        ap.error(f"--peers: unknown peer(s) {', '.join(bad)}; it takes some of {', '.join(PEERS)}, or '' for none")
    assert a.clients >= 1 and a.turns >= 1 and a.rounds >= 1
    if a.baseline_tree is not None:
        a.baseline_tree = a.baseline_tree.resolve()
        assert (a.baseline_tree / "controller" / "proxy").is_dir(), f"{a.baseline_tree} is not a kvfleet tree"
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        res, hops = asyncio.run(run(a, pathlib.Path(tmp)))
    section = report(res, a, (load0, os.getloadavg()[0]), hops)
    print(section)
    if not a.no_docs and not a.solo_only:
        write_docs(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
