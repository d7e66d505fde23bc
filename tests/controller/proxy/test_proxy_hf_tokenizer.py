"""`--tokenizer hf:PATH`: a local Hugging Face tokenizer stands in for the workers' /tokenize only for
models where it gave the workers' own ids on the parity probes; a tokenizer that differs is refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.hf_tokenizer import build_hf_tokenizer
from support.proxy_fleet import MODEL, served, start_fleet, until

from controller.proxy.config import ProxyConfig
from controller.proxy.server import Proxy
from controller.proxy.tokenize import PROBES
from fleet.app.testkit.sim_vllm import tokenizer as simtok
from fleet.core.errors import InvalidArgument

PROMPTS = ["Plan the delivery route for truck seven, then report.", "And the return trip?"]


async def test_local_tokenizer_with_parity_replaces_the_tokenize_hop(tmp_path: Path) -> None:
    hf = build_hf_tokenizer(tmp_path / "tok", PROMPTS)
    fleet = await start_fleet(tmp_path, tokenizer=f"hf:{hf}")
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        local = fleet.proxy.tokenizer._hf_ids({"messages": msgs})
        print("local ids == the worker's chat-template ids:", local == simtok.apply_chat_template(msgs), len(local))
        assert local == simtok.apply_chat_template(msgs)
        rows = []
        for _ in range(3):
            status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                                       "max_tokens": 4})
            assert status == 200, raw
            body = json.loads(raw)
            rows.append((h["x-kvfleet-worker"], h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"]),
                         body["usage"]["prompt_tokens_details"]["cached_tokens"]))
            await until(lambda w=h["x-kvfleet-worker"]: fleet.blocks_known(w),
                        lambda n, p=body["usage"]["prompt_tokens"]: n >= p // 16)
            # NOTE: user turns only: this toy vocabulary has no entry for the stand-in's generated words
            msgs = msgs + [{"role": "user", "content": PROMPTS[1]}]
        tokenize_calls = sum(len(served(s, "/tokenize")) for s in fleet.sims.values())
        print("turns (worker, verdict, matched, worker-cached):", rows, "| worker /tokenize calls:", tokenize_calls)
        assert fleet.proxy.tokenizer.parity == {MODEL: True}
        assert tokenize_calls == len(PROBES)  # only the parity probes; every request was tokenized locally
        assert [r[1] for r in rows] == ["COLD", "WARM", "WARM"] and all(r[2] == r[3] for r in rows)
    finally:
        await fleet.stop()


async def test_a_tokenizer_that_differs_is_not_used(tmp_path: Path) -> None:
    hf = build_hf_tokenizer(tmp_path / "tok", PROMPTS, skew_word="fox")  # one probe word maps to another id
    fleet = await start_fleet(tmp_path, tokenizer=f"hf:{hf}")
    try:
        for _ in range(2):
            status, _, raw = await fleet.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0] + " x",
                                                                  "max_tokens": 2})
            assert status == 200, raw
        tokenize_calls = sum(len(served(s, "/tokenize")) for s in fleet.sims.values())
        print("skewed tokenizer: parity", fleet.proxy.tokenizer.parity, "| worker /tokenize calls:", tokenize_calls)
        assert fleet.proxy.tokenizer.parity == {MODEL: False}
        assert tokenize_calls == 1 + 1  # the failed probe, then the workers' /tokenize (cached for the repeat)
    finally:
        await fleet.stop()


async def test_no_tokenizer_at_the_path_is_one_sentence_and_the_proxy_closes_what_it_opened(tmp_path: Path) -> None:
    # before: the hub's "Repo id must be in the form 'repo_name' ..." and then "Unclosed client session" (review)
    missing = tmp_path / "no" / "such"
    proxy = Proxy(ProxyConfig(controller="127.0.0.1:1", listen="127.0.0.1:0", tokenizer=f"hf:{missing}"))
    with pytest.raises(InvalidArgument, match=f"no tokenizer at {missing} \\(no such directory\\)"):
        await proxy.start()
    assert proxy.http.closed
    empty = tmp_path / "empty"  # a directory with no tokenizer in it: the loader's reason, in one line
    empty.mkdir()
    with pytest.raises(InvalidArgument, match=f"no tokenizer at {empty} \\(.+\\)") as e:
        await Proxy(ProxyConfig(controller="127.0.0.1:1", listen="127.0.0.1:0", tokenizer=f"hf:{empty}")).start()
    assert "\n" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "fleet.app.cli.main", "proxy", "--controller", "127.0.0.1:1",
                        "--listen", "127.0.0.1:0", "--tokenizer", f"hf:{missing}"], capture_output=True, text=True,
                       timeout=120)
    print(r.stderr)
    assert r.returncode == 2 and f"kvfleet proxy: error: --tokenizer hf:{missing}: no tokenizer at {missing}" in r.stderr
    assert "Unclosed" not in r.stderr and "Repo id" not in r.stderr


async def test_one_tenants_long_prompts_do_not_queue_anothers_local_tokenizing(tmp_path: Path) -> None:
    """With a local tokenizer, one tenant's flood of long prompts (24 at once) leaves another tenant's short
    prompt a thread: it is tokenized while most of the flood still waits. Before, every prompt went to the one
    default thread pool, first come first served (6 threads on 2 cores): the short prompt waited for the flood,
    finishing after 19 or more of its 24, about a second at 0.1 s of tokenizing each."""
    hf = build_hf_tokenizer(tmp_path / "tok", PROMPTS)
    fleet = await start_fleet(tmp_path, num_workers=1, tokenizer=f"hf:{hf}")
    try:
        status, _, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": PROMPTS[0]}]})
        assert status == 200 and fleet.proxy.tokenizer.parity == {MODEL: True}, raw
        tok, done = fleet.proxy.tokenizer, []

        async def ids(tenant: str, content: str) -> None:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            assert await tok.token_ids(chat, True, MODEL, tenant)
            done.append(tenant)

        flood = [asyncio.ensure_future(ids("acme", f"{i} " + (PROMPTS[0] + " ") * 1500)) for i in range(24)]
        await asyncio.sleep(0)  # the flood's jobs are handed to the threads first
        await ids("bravo", PROMPTS[1])
        await asyncio.gather(*flood)
        print("acme's long prompts tokenized before bravo's short one:", done.index("bravo"), "of 24")
        assert done.index("bravo") <= 8
    finally:
        await fleet.stop()


async def test_chat_template_kwargs_repeating_the_requests_own_fields_tokenize_as_the_workers_do(
        tmp_path: Path) -> None:
    """`chat_template_kwargs` may repeat a field the request has (add_generation_prompt, continue_final_message,
    tools, chat_template, even tokenize): vLLM merges them, the request's own field winning where it is set, and the
    local tokenizer gives the worker's /tokenize ids. Before, the proxy passed both to apply_chat_template: a
    TypeError ("got multiple values for keyword argument"), a 500 for the chat."""
    hf = build_hf_tokenizer(tmp_path / "tok", PROMPTS)
    fleet = await start_fleet(tmp_path, num_workers=1, tokenizer=f"hf:{hf}")
    try:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        kwargs = {"add_generation_prompt": False, "continue_final_message": True, "tools": [], "tokenize": False}
        for extra in ({}, {"add_generation_prompt": True}, {"add_generation_prompt": False}):
            body = {"model": MODEL, "messages": msgs, "max_tokens": 1, "chat_template_kwargs": kwargs, **extra}
            status, h, raw = await fleet.post("/v1/chat/completions", body)
            sim = next(iter(fleet.sims.values()))
            remote = await fleet.proxy.tokenizer._post_tokenize(sim.url, json.dumps(
                {"model": MODEL, "messages": msgs, "chat_template_kwargs": kwargs, **extra}).encode())
            local = fleet.proxy.tokenizer._hf_ids({"messages": msgs, "chat_template_kwargs": kwargs, **extra})
            print(extra, "->", status, "| local ids == the worker's /tokenize ids:", local == remote, len(local))
            assert status == 200, raw
            assert local == remote == simtok.apply_chat_template(msgs, add_generation_prompt=extra.get(
                "add_generation_prompt", True))
        assert fleet.proxy.tokenizer.parity == {MODEL: True}  # the chats were tokenized locally
        status, _, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1,
                                                                   "chat_template_kwargs": ["add_generation_prompt"]})
        assert status == 400 and b"'chat_template_kwargs' must be an object" in raw, raw  # was a 500 (TypeError)
    finally:
        await fleet.stop()


async def test_parity_is_checked_under_a_name_the_workers_serve(tmp_path: Path) -> None:
    """Workers that serve the registered model only under another name (vLLM's --served-model-name) are probed under
    that name. Before, the probes named the registered model: the workers' 404, so parity stayed unknown and each
    chat not in the token cache paid a failed probe and the workers' /tokenize, with a warning (4 calls here)."""
    hf = build_hf_tokenizer(tmp_path / "tok", PROMPTS)
    fleet = await start_fleet(tmp_path, num_workers=2, tokenizer=f"hf:{hf}",
                              engine_kw={"served_model_names": ("sim-alias",)})
    try:
        for i in range(3):
            msgs = [{"role": "user", "content": PROMPTS[i % 2]}]
            status, _, raw = await fleet.post("/v1/chat/completions", {"model": "sim-alias", "max_tokens": 1,
                                                                       "messages": msgs})
            assert status == 200, raw
        tokenize_calls = sum(len(served(s, "/tokenize")) for s in fleet.sims.values())
        print("parity:", fleet.proxy.tokenizer.parity, "| worker /tokenize calls for 3 chats:", tokenize_calls)
        assert fleet.proxy.tokenizer.parity == {MODEL: True}
        assert tokenize_calls == len(PROBES)  # the probes only: every chat was tokenized locally
    finally:
        await fleet.stop()
