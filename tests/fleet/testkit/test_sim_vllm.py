"""The vLLM stand-in speaks vLLM's surfaces and reproduces its hazards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest
import zmq
import zmq.asyncio

from controller.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, parse_seq
from controller.vllm.http import parse_metrics
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.core.block_hash import HashConfig, external_chain


@pytest.fixture
async def sim():
    s = await SimVllm(
        SimConfig(engine=SimEngineConfig(model="m", num_blocks=8, loras={"sql": "/adapters/sql"}))
    ).start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(s.kv_events)
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(0.2)
        yield s, http, sub
    sub.close(0)
    ctx.term()
    await s.stop()


async def _recv(sub, timeout=10.0):  # NOTE: 1 s before: the batch waited for is on its way, a loaded machine is slow
    f = await asyncio.wait_for(sub.recv_multipart(), timeout)
    return parse_seq(f[1]), decode_batch(f[2]).events


async def _post(http, url, **kw):
    async with http.post(url, **kw) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def test_dev_endpoints_exact_bodies(sim) -> None:
    s, http, _ = sim
    u = s.url
    assert await _post(http, u + "/sleep", params={"level": "3"}) == (
        422,
        {"detail": "invalid level or mode"},
    )
    assert await _post(http, u + "/sleep", params={"level": "1"}) == (200, {"status": "sleeping", "level": 1})
    async with http.get(u + "/health") as r:
        assert r.status == 200  # NOTE: 200 while asleep, as vLLM
    async with http.get(u + "/is_sleeping") as r:
        assert await r.json() == {"is_sleeping": True}
    m = parse_metrics(await (await http.get(u + "/metrics")).text())
    assert (
        m.sleep_state == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0} and m.block_size == 16
    )
    assert await _post(http, u + "/wake_up", params=[("tags", "weights")]) == (
        200,
        {"status": "sleeping", "tags": ["weights"]},
    )  # partial wake: still asleep
    assert await _post(http, u + "/wake_up") == (200, {"status": "awake", "tags": None})
    assert await _post(http, u + "/reset_prefix_cache") == (200, {"success": True})
    assert (await _post(http, u + "/release_kv_cache_memory"))[0] == 400  # needs a completed pause
    assert await _post(http, u + "/pause", params={"mode": "bogus"}) == (400, {"error": "invalid pause mode 'bogus'"})
    # a bool query parameter as FastAPI reads one: a value it refuses is a 422 (it was a 400), "yes" is true (was
    # refused)
    assert (await _post(http, u + "/pause", params={"clear_cache": "garbage"}))[0] == 422
    assert (await _post(http, u + "/reset_prefix_cache", params={"reset_running_requests": "no"})) == \
        (200, {"success": True})
    assert await _post(http, u + "/pause", params={"clear_cache": "yes"}) == (200, {"status": "paused"})
    assert await _post(http, u + "/resume") == (200, {"status": "resumed"})
    assert await _post(http, u + "/pause") == (200, {"status": "paused"})
    assert (await _post(http, u + "/v1/completions", json={"prompt": [1, 2, 3]}))[0] == 503  # abort: rejected
    assert await _post(http, u + "/release_kv_cache_memory") == (200, {"status": "kv_cache_released"})
    assert await _post(http, u + "/resume") == (200, {"status": "resumed"})
    async with http.get(u + "/version") as r:
        assert await r.json() == {"version": "0.33.0"}
    async with http.get(u + "/v1/models") as r:
        cards = {c["id"]: c for c in (await r.json())["data"]}
    assert cards["sql"]["root"] == "/adapters/sql" and cards["sql"]["parent"] == "m"


async def test_tokenize_and_completions(sim) -> None:
    s, http, _ = sim
    st, body = await _post(http, s.url + "/tokenize", json={"prompt": "hello world, again"})
    assert st == 200 and body["count"] == len(body["tokens"]) == 4
    st, chat = await _post(http, s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"][0] == 151644
    st, c = await _post(http, s.url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 3})
    assert (
        st == 200
        and c["usage"]["prompt_tokens"] == 40
        and c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )
    st, c2 = await _post(http, s.url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 3})
    assert c2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 and c2["choices"] == c["choices"]
    async with http.post(
        s.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2},
    ) as r:
        text = await r.text()
    assert text.count("data: ") == 3 and text.rstrip().endswith("data: [DONE]")  # as vLLM: no usage chunk unasked
    async with http.post(
        s.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2,
              "stream_options": {}},  # include_usage true by default there
    ) as r:
        text = await r.text()
    assert text.count("data: ") == 4 and '"choices": [], "usage": {' in text and text.rstrip().endswith("data: [DONE]")
    assert (await _post(http, s.url + "/v1/completions", json={"model": "nope", "prompt": "x"}))[0] == 404
    assert (await _post(http, s.url + "/v1/completions", data=b"{junk"))[0] == 400


async def test_hazards_queued_clear_hang_eviction_restart(sim) -> None:
    s, http, sub = sim
    cfg = HashConfig("sha256", None, 16)
    await _post(http, s.url + "/v1/completions", json={"prompt": list(range(64))})
    seq, evs = await _recv(sub)
    assert (
        seq == 0
        and isinstance(evs[0], BlockStored)
        and list(evs[0].block_hashes) == external_chain(cfg, list(range(64)))
    )
    await _post(http, s.url + "/sleep", params={"level": "1"})
    with pytest.raises(asyncio.TimeoutError):
        await _recv(sub, 0.3)  # AllBlocksCleared is only queued
    hung = asyncio.create_task(_post(http, s.url + "/v1/completions", json={"prompt": list(range(100, 164))}))
    await asyncio.sleep(0.3)
    assert not hung.done()  # a request to a sleeping engine hangs
    await _post(http, s.url + "/wake_up")
    assert (await hung)[0] == 200
    seq, evs = await _recv(sub)
    assert seq == 1 and isinstance(evs[0], AllBlocksCleared) and isinstance(evs[1], BlockStored)
    # 8 blocks of capacity: a second 4-block prompt evicts LRU blocks one BlockRemoved each
    await _post(http, s.url + "/v1/completions", json={"prompt": list(range(200, 280))})
    seq, evs = await _recv(sub)
    assert [type(e).__name__ for e in evs].count("BlockRemoved") == 1 and isinstance(evs[-1], BlockStored)
    async with http.get(s.url + "/sim/cache") as r:
        truth = await r.json()
    assert len(truth["block_hashes"]) == 8
    removed = [h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert not set(removed) & set(truth["block_hashes"])
    await _post(http, s.url + "/sim/restart")
    await _post(http, s.url + "/v1/completions", json={"prompt": list(range(32))})
    seq, _ = await _recv(sub)
    assert seq == 0  # seq restarts at 0


async def test_dropped_events_stay_replayable(sim) -> None:
    s, http, sub = sim
    await _post(http, s.url + "/sim/drop_next_events", params={"n": "1"})
    await _post(http, s.url + "/v1/completions", json={"prompt": list(range(32))})
    await _post(http, s.url + "/v1/completions", json={"prompt": list(range(50, 82))})
    seq, _ = await _recv(sub)
    assert seq == 1  # seq 0 was lost on PUB
    d = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    d.connect(s.replay)
    await d.send_multipart([b"", (0).to_bytes(8, "big")])
    got = []
    while True:
        f = await asyncio.wait_for(d.recv_multipart(), 10)
        if f[2] == b"\xff" * 8:
            break
        got.append(parse_seq(f[2]))
    d.close(0)
    assert got == [0, 1]


def test_cli_prints_endpoints_json() -> None:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleet.app.cli.main",
            "sim-vllm",
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--replay-port",
            "0",
            "--model",
            "m",
            "--block-size",
            "16",
            "--num-blocks",
            "32",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(p.stdout.readline())
        assert info["model"] == "m" and info["url"].startswith("http://127.0.0.1:")
        assert info["kv_events"].startswith("tcp://") and info["replay"].startswith("tcp://")
        import urllib.request

        with urllib.request.urlopen(info["url"] + "/is_sleeping", timeout=5) as r:
            assert json.loads(r.read()) == {"is_sleeping": False}
    finally:
        p.terminate()
        assert p.wait(10) == 0


TOOL_CALL_TURN = [
    {"role": "user", "content": "search weather"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


async def test_an_assistant_turn_with_null_content_and_tool_calls_is_served(sim) -> None:
    """OpenAI's shape of a tool-calling turn ("content": null), which vLLM accepts: the stand-in renders the null
    content as empty text (found by review: its tokenizer answered 400)."""
    from fleet.app.testkit.sim_vllm.tokenizer import apply_chat_template

    s, http, _ = sim
    st, body = await _post(http, s.url + "/v1/chat/completions", json={"model": "m", "messages": TOOL_CALL_TURN,
                                                                       "max_tokens": 2})
    assert st == 200, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    st, tok = await _post(http, s.url + "/tokenize", json={"model": "m", "messages": TOOL_CALL_TURN})
    empty = [dict(m, content="") if m["content"] is None else m for m in TOOL_CALL_TURN]
    assert st == 200 and tok["tokens"] == apply_chat_template(empty)
    # Control: content that is neither text, parts nor null is still refused.
    bad = [TOOL_CALL_TURN[0], dict(TOOL_CALL_TURN[1], content=7)]
    assert (await _post(http, s.url + "/v1/chat/completions", json={"model": "m", "messages": bad}))[0] == 400


def _sim_cli(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet.app.cli.main", "sim-vllm", *flags], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("flag", ["--port", "--kv-events-port", "--replay-port"])
def test_a_busy_port_is_one_line_naming_the_port_and_its_flag(flag: str) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _sim_cli(flag, str(port))
    print(r.stderr)
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"127.0.0.1:{port}" in r.stderr and flag in r.stderr


@pytest.mark.parametrize(("flag", "value"), [
    ("--block-size", "0"), ("--num-blocks", "1"), ("--time-scale", "-1"), ("--max-num-seqs", "0"),
    ("--max-num-batched-tokens", "0"), ("--prefill-tokens-per-s", "0"), ("--step-overhead-s", "-0.1"),
    ("--decode-base-s", "-1"), ("--decode-per-seq-s", "nan"), ("--port", "65536"), ("--kv-events-port", "-1"),
    ("--replay-port", "-2"), ("--buffer-steps", "-1"),
])
def test_each_bad_setting_is_refused_naming_its_flag(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.testkit.sim_vllm.main import _parse

    with pytest.raises(SystemExit) as e:
        _parse([flag, value])
    err = capsys.readouterr().err
    print(err)
    assert e.value.code == 2 and f"error: {flag} must be" in err and "clock settings" not in err
    good = {"--num-blocks": "2", "--decode-per-seq-s": "0", "--port": "65535", "--replay-port": "-1"}
    _parse([flag, good.get(flag, "1")])  # control: the edge of each range is taken


def test_the_engine_settings_are_checked_without_asserts() -> None:
    """A real check, kept under `python -O` (an assert would let block_size=0 through)."""
    from fleet.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="--block-size must be at least 1, got 0"):
        SimEngineConfig(block_size=0)
    r = subprocess.run([sys.executable, "-O", "-c", "from fleet.app.testkit.sim_vllm.config import SimEngineConfig\n"
                        "SimEngineConfig(block_size=0)"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--block-size must be at least 1" in r.stderr


@pytest.fixture
async def clocked():
    """The stand-in with its clock on (fast: a hundredth of real time), 8 blocks of KV."""
    cfg = SimEngineConfig(model="m", num_blocks=8, time_scale=0.01)
    s = await SimVllm(SimConfig(engine=cfg)).start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(s.kv_events)
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(0.2)
        yield s, http, sub
    sub.close(0)
    ctx.term()
    await s.stop()


async def test_clocked_hazards_still_hold(clocked) -> None:
    s, http, sub = clocked
    assert (await _post(http, s.url + "/v1/completions", json={"prompt": list(range(64))}))[0] == 200
    seq, evs = await _recv(sub)
    assert seq == 0 and isinstance(evs[0], BlockStored)
    await _post(http, s.url + "/sleep", params={"level": "1"})
    hung = asyncio.create_task(_post(http, s.url + "/v1/completions", json={"prompt": list(range(100, 164))}))
    await _until_waiting(http, s, 1)  # queued on the sleeping engine
    with pytest.raises(asyncio.TimeoutError):
        await _recv(sub, 0.3)  # AllBlocksCleared is only queued
    assert not hung.done()
    await _post(http, s.url + "/wake_up")
    assert (await hung)[0] == 200
    seq, evs = await _recv(sub)
    assert seq == 1 and isinstance(evs[0], AllBlocksCleared) and isinstance(evs[1], BlockStored)
    # a stream in flight holds its blocks: reset answers success:false; sleep(abort) ends the stream
    async with http.post(
        s.url + "/v1/completions", json={"prompt": list(range(32)), "max_tokens": 8000, "stream": True,
                                   "stream_options": {"include_usage": True}}
    ) as r:
        await r.content.readuntil(b"\n\n")
        assert await _post(http, s.url + "/reset_prefix_cache") == (200, {"success": False})
        await _post(http, s.url + "/sleep", params={"level": "0"})  # mode abort (the default)
        chunks = [
            json.loads(line[6:]) for line in (await r.text()).split("\n\n") if line.startswith("data: {")
        ]
    fins = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert (
        fins[-1] == "abort"
        and set(fins[:-1]) == {None}
        and chunks[-1]["usage"]["completion_tokens"] < 8000
    )
    assert parse_metrics(await (await http.get(s.url + "/metrics")).text()).running == 0
    # restart while a request waits on the sleeping engine: it fails with 503, as before
    queued = asyncio.create_task(_post(http, s.url + "/v1/completions", json={"prompt": [1, 2, 3]}))
    await _until_waiting(http, s, 1)
    await _post(http, s.url + "/sim/restart")
    assert (await queued)[0] == 503


async def _until_waiting(http, s, n: int, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if parse_metrics(await (await http.get(s.url + "/metrics")).text()).waiting == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"vllm:num_requests_waiting never reached {n}")


async def test_a_reset_with_reset_running_requests_preempts_and_the_request_still_completes(clocked) -> None:
    """vLLM's `reset_running_requests=true`: the reset happens at once, the running request is preempted (its
    blocks freed, its prompt computed again; like vLLM, vllm:prefix_cache_queries_total counts only its first
    scheduling, and the stand-in counts the recompute in sim:preempted_prefill_tokens_total) and still answers."""
    s, http, sub = clocked
    prompt = list(range(500, 564))  # 4 full blocks
    async with http.post(
        s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "stream": True}
    ) as r:
        await r.content.readuntil(b"\n\n")  # prefilled and decoding: it holds its blocks
        assert await _post(http, s.url + "/reset_prefix_cache") == (200, {"success": False})  # control
        assert (await _post(http, s.url + "/reset_prefix_cache", params={"reset_running_requests": "bogus"}))[0] == 422
        assert await _post(http, s.url + "/reset_prefix_cache", params={"reset_running_requests": "true"}) == (
            200, {"success": True}
        )
        chunks = [json.loads(x[6:]) for x in (await r.text()).split("\n\n") if x.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert s.engine.sched.stats.num_preemptions == 1
    # computed again from nothing (the reset emptied the cache), counted apart from vLLM's query counter
    m = await (await http.get(s.url + "/metrics")).text()
    again = [float(x.rsplit(" ", 1)[1]) for x in m.splitlines() if x.startswith("sim:preempted_prefill_tokens_total")]
    assert again == [len(prompt)]
    # the clear is published with the next step, before the recomputed request's blocks are stored again
    kinds = []
    for _ in range(5):
        try:
            _, evs = await _recv(sub, 2.0)
        except TimeoutError:
            break
        kinds += [type(e).__name__ for e in evs]
        if "AllBlocksCleared" in kinds and kinds[-1] == "BlockStored":
            break
    assert "AllBlocksCleared" in kinds and kinds.index("AllBlocksCleared") < len(kinds) - 1


async def test_a_reset_with_only_waiting_requests_succeeds_as_in_vllm(clocked) -> None:
    """vLLM refuses a reset while blocks are held; a waiting request holds none (a preempted one gave its back), so
    with requests queued and none running the reset succeeds, and the queued request then runs. Before, the stand-in
    refused it too, so the controller's drain waited on the whole queue (a sleeping engine's waiters here)."""
    s, http, _sub = clocked
    await _post(http, s.url + "/sleep", params={"level": "1"})
    queued = asyncio.create_task(_post(http, s.url + "/v1/completions", json={"prompt": list(range(700, 732))}))
    await _until_waiting(http, s, 1)
    assert s.engine.running == 0
    assert await _post(http, s.url + "/reset_prefix_cache") == (200, {"success": True})
    await _post(http, s.url + "/wake_up")
    assert (await queued)[0] == 200


async def test_the_publisher_and_metrics_settings_are_vllms() -> None:
    """vLLM's KVEventsConfig defaults: the PUB's high-water mark 100,000 (ZMQ's own, 1,000, dropped a slow
    subscriber's batches 100x sooner), and /kv_event_sources lists it; /metrics labels the served model name, as
    vLLM's loggers do (the --model path was given). Review findings."""
    from fleet.app.testkit.sim_vllm.publisher import PUB_HWM

    s = await SimVllm(SimConfig(engine=SimEngineConfig(model="/models/m", served_model_names=("served-a", "b"),
                                                       num_blocks=8))).start()
    try:
        assert s.publisher is not None and s.publisher._pub.getsockopt(zmq.SNDHWM) == PUB_HWM == 100_000
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url + "/kv_event_sources") as r:
                src = (await r.json())["0"]
            async with http.get(s.url + "/metrics") as r:
                text = await r.text()
        assert (src["hwm"], src["max_queue_size"]) == (100_000, 100_000)
        assert 'model_name="served-a"' in text and 'model_name="/models/m"' not in text
    finally:
        await s.stop()
