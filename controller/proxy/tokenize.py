"""Token ids exactly as the target vLLM computes them: its own /tokenize (chat template included), cached.

Every worker of a model tokenizes identically, so any serving worker of the model may answer
before the router has chosen one. Or, with `--tokenizer hf:PATH`, a local Hugging Face tokenizer
(which must be the one the workers load, with the same chat template).

The cache (controller/proxy/token_cache.py) is keyed by (tenant, model, SHA-256 of the tokenize request), so one
tenant's hit never reveals another tenant's text through timing; it is bounded in bytes as well as entries, and
one tenant's flood evicts its own entries before another's. A batched completions prompt's later prompts are
tokenized by controller/proxy/batch_prompts.py, each through `Tokenizer.ids_of`.

A local tokenizer runs on LOCAL_THREADS threads of its own, a tenant's prompts on at most three quarters of them
(the rest wait their turn in the tenant's lane), so one tenant's flood of long prompts leaves another a thread.
NOTE: they ran on asyncio's default pool, first come first served: another tenant's short prompt waited behind the
whole flood (after 19 of 24 long prompts in tests/controller/proxy/test_proxy_hf_tokenizer.py; about a second).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import msgspec

from controller.keyed_slots import KeyedSlots
from controller.proxy.batch_prompts import BATCH_TOKENIZE_AT_ONCE, batch_of, prompt_request
from controller.proxy.chat_args import add_special_tokens, chat_template_args
from controller.proxy.config import ProxyConfig
from controller.proxy.conversation import conversation
from controller.proxy.directory import WorkerDirectory
from controller.proxy.errors import ProxyError
from controller.proxy.prefill import with_documents
from controller.proxy.token_cache import TokenCache
from controller.vllm.http import read_capped
from fleet.core.errors import InvalidArgument

log = logging.getLogger("kvfleet.proxy")
# NOTE: a local tokenizer is used for a model only after it gave the worker's own ids on these probes
PROBES: tuple[dict[str, Any], ...] = (
    {"prompt": "Hello, world! The quick brown fox jumps over the lazy dog."},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is 2 + 2?"}]},
    # NOTE: a chat of text parts, which vLLM joins with "\n" (controller/proxy/conversation.py) unless the template
    # reads the parts themselves: a local render that differs from the workers' is refused here, not routed on
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."},
                                                 {"type": "text", "text": "Answer in one word."}]},
                  {"role": "user", "content": "What is 2 + 2?"}]},
)
JSON_HEADERS = {"Content-Type": "application/json"}
LOCAL_THREADS = min(32, (os.cpu_count() or 1) + 4)  # the size of asyncio's default pool, which they ran on before
JSON = msgspec.json.Encoder()
ANSWER = msgspec.json.Decoder()


class _Tokenized(msgspec.Struct):
    tokens: list[int]  # vLLM's /tokenize answer also has count, max_model_len and token_strs: ignored


TOKENS = msgspec.json.Decoder(_Tokenized)  # NOTE: validated in C: ids as plain ints, no per-id Python work
# the chat completions fields that change the rendered prompt and that vLLM's /tokenize takes as they are
CHAT_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
             "add_special_tokens", "mm_processor_kwargs", "media_io_kwargs")


class EncodedBody:
    """One request body's JSON, each top-level value encoded at most once.

    The /tokenize request and the body forwarded to the worker carry the same messages (or prompt): encoding
    them twice cost about 1 ms per 200 KB of conversation on a 2-core machine (json.dumps), per request. The
    encoder is msgspec's (compact UTF-8 JSON): about 10x faster than json.dumps on a conversation, whose
    ensure_ascii escaping was most of the proxy's JSON work (docs/proxy.md).
    """

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self._done: dict[str, bytes] = {}

    def encode(self, obj: dict[str, Any]) -> bytes:
        """msgspec.json.encode(obj), byte for byte; a value that is the body's own (same key, same object) is
        encoded once for every call. NOTE: joined once (each value's bytes are copied once more, not per piece)."""
        out = [b"{"]
        for k, v in obj.items():
            if k in self.body and self.body[k] is v:
                b = self._done.get(k)
                if b is None:
                    b = self._done[k] = JSON.encode(v)
            else:
                b = JSON.encode(v)
            out += (JSON.encode(k), b":", b, b",")
        if len(out) > 1:
            out.pop()
        out.append(b"}")
        return b"".join(out)


def max_answer_bytes(max_body_bytes: int) -> int:
    """The most of a worker's /tokenize-sized answer read: the ids of the largest prompt the proxy accepts (a prompt
    of n bytes has at most n ids, each at most 8 bytes of JSON), plus 64 KiB."""
    return 8 * max_body_bytes + (64 << 10)


def tokenize_request(body: dict[str, Any], chat: bool) -> dict[str, Any] | list[int]:
    """The /tokenize body for an OpenAI request, or the ids themselves when the prompt is already ids.

    Of a batched completions prompt (a list of prompts), its first (batch_prompts.batch_requests: the others);
    `prompt_embeds` with no prompt is routed by load alone (no ids).
    """
    model = body["model"]
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ProxyError(400, "'messages' must be a non-empty list of message objects", "messages")
        return with_documents({"model": model, "messages": msgs, **{k: body[k] for k in CHAT_KEYS if k in body}},
                              body)
    p = body.get("prompt")
    if p is None and body.get("prompt_embeds") is not None:
        # NOTE: vLLM (--enable-prompt-embeds) takes embeddings in place of a prompt; there are no ids to match
        # against any worker's blocks, so the request is routed by load alone (the worker checks the embeddings)
        return []
    batch = batch_of(p)
    return prompt_request(body, p) if batch is None else prompt_request(body, batch[0], "prompt[0]")  # its first


def load_hf_tokenizer(path: str) -> Any:
    """`--tokenizer hf:PATH`'s tokenizer, local files only; InvalidArgument in one sentence when there is none.

    NOTE: PATH may also be a repo id already in the local Hugging Face cache; for a path that does not exist the
    hub's own error was about repo ids ("Repo id must be in the form ..."), so the path is checked first.
    """
    from transformers import AutoTokenizer

    looks_like_path = path.startswith((os.sep, ".", "~")) or path.count("/") > 1
    if looks_like_path and not os.path.isdir(os.path.expanduser(path)):
        raise InvalidArgument(f"--tokenizer hf:{path}: no tokenizer at {path} (no such directory)")
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(path), local_files_only=True)
    except (OSError, ValueError) as e:  # the hub's HFValidationError is a ValueError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidArgument(f"--tokenizer hf:{path}: no tokenizer at {path} ({reason})") from e


class Tokenizer:
    """token_ids(body, chat, base, tenant): via a worker's /tokenize (default) or a local HF tokenizer."""

    def __init__(self, cfg: ProxyConfig, directory: WorkerDirectory, http: aiohttp.ClientSession) -> None:
        self.cfg, self.directory, self.http = cfg, directory, http
        self.cache = TokenCache(cfg.tokenize_cache_size, cfg.tokenize_cache_bytes)
        self._hf: Any = None
        self.parity: dict[str, bool] = {}  # model -> the local tokenizer gave the worker's ids on PROBES
        self._parity_lock = asyncio.Lock()
        self.num_calls = 0
        self.num_hits = 0
        self._timeout = aiohttp.ClientTimeout(total=cfg.tokenize_timeout_s, sock_connect=cfg.connect_timeout_s)
        self._pool: ThreadPoolExecutor | None = None  # the local tokenizer's threads
        self._lanes = KeyedSlots(LOCAL_THREADS - LOCAL_THREADS // 4, LOCAL_THREADS, key_name="tenant",
                                 name="local tokenizer threads")
        # a batch's later prompts' /tokenize calls, per tenant (batch_prompts.batch_ids)
        self.batch_lanes = KeyedSlots(BATCH_TOKENIZE_AT_ONCE, key_name="tenant", name="batch /tokenize calls")

    async def start(self) -> None:
        if self.cfg.tokenizer:
            path = self.cfg.tokenizer[len("hf:"):]
            self._hf = await asyncio.to_thread(load_hf_tokenizer, path)
            self._pool = ThreadPoolExecutor(LOCAL_THREADS, thread_name_prefix="kvfleet-tokenize")

    def close(self) -> None:
        """Let the local tokenizer's threads go (a job still running ends on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _local(self, tenant: str, req: dict[str, Any]) -> list[int] | None:
        """The local tokenizer's ids, on one of the tenant's threads. A request cancelled meanwhile (its client went
        away) keeps the thread's slot until the job ends: freed at once, a tenant that kept cancelling would run
        more jobs than its share, and the next tenant's would queue in the pool behind them."""
        assert self._pool is not None
        async with self._lanes.hold(tenant, None, "tokenize"):
            job = asyncio.get_running_loop().run_in_executor(self._pool, self._hf_ids, req)
            try:
                return await asyncio.shield(job)
            finally:
                if not job.done():
                    await asyncio.wait({job})

    async def token_ids(self, body: dict[str, Any], chat: bool, base: str, tenant: str,
                        enc: EncodedBody | None = None) -> Sequence[int]:
        """`enc`: the body's encoder, whose encoding of the messages (or prompt) the forward then reuses."""
        return await self.ids_of(tokenize_request(body, chat), body, base, tenant, enc)

    async def ids_of(self, req: dict[str, Any] | list[int], body: dict[str, Any], base: str, tenant: str,
                      enc: EncodedBody | None = None) -> Sequence[int]:
        """The ids of one /tokenize request `req` of `body` (cached per tenant), or `req` when it is ids already."""
        if isinstance(req, list):
            return req
        # NOTE: encoded once: the same bytes key the cache and are POSTed to /tokenize (a long conversation's body
        # is most of a request's JSON work); keyed in the client's key order, so a reordered body only misses
        data = (enc or EncodedBody(body)).encode(req)
        key = (base, hashlib.sha256(data).digest())
        hit = self.cache.get(tenant, key)
        if hit is not None:
            self.num_hits += 1
            return hit
        local = self._hf is not None and await self.local_ok(base)
        ids = await self._local(tenant, req) if local else None
        if ids is None:  # no local tokenizer for the model, or a chat it does not render (a media part)
            ids = await self._remote(data, base, body["model"])
        self.cache.put(tenant, key, ids)
        return ids

    async def local_ok(self, base: str) -> bool:
        """Whether the local tokenizer may stand in for `base`'s workers (checked once, on PROBES)."""
        if base not in self.parity:
            async with self._parity_lock:
                if base not in self.parity:
                    await self._check_parity(base)
        return self.parity.get(base, False)

    async def _check_parity(self, base: str) -> None:
        # NOTE: probed under the registered name, workers serving the model under other names answered 404: parity
        # was never known, and every request paid a failed probe and the workers' /tokenize (and a warning)
        name = self.directory.served_name(base)
        urls = self.directory.tokenizer_urls(base, listing=name)
        if not urls:
            return  # no worker to compare with yet: use the workers' /tokenize, check again next time
        try:
            for probe in PROBES:
                req = {"model": name, **probe}
                remote = await self._post_tokenize(urls[0], JSON.encode(req))
                local = await asyncio.to_thread(self._hf_ids, req)
                if remote != local:
                    log.error("local tokenizer %s differs from the workers of %s (%s: %d vs %d ids); using the "
                              "workers' /tokenize for it", self.cfg.tokenizer, base, next(iter(probe)),
                              len(local or ()), len(remote))
                    self.parity[base] = False
                    return
        except (aiohttp.ClientError, TimeoutError, ProxyError) as e:
            log.warning("tokenizer parity check for %s failed (%s); will retry", base, e)
            return
        self.parity[base] = True

    async def _remote(self, data: bytes, base: str, name: str | None = None) -> list[int]:
        """Ids from a worker of `base` that lists `name` (the request's model: a LoRA may be on some workers only);
        the next one's when the first cannot be reached, or 404s the model (it unloaded the adapter since the
        directory read its cards)."""
        urls = self.directory.tokenizer_urls(base, listing=name)
        if not urls:
            raise ProxyError(503, f"no registered worker of model {base!r} to tokenize with")
        last: ProxyError | None = None
        for url in urls[:2]:
            try:
                return await self._post_tokenize(url, data)
            except (TimeoutError, aiohttp.ClientError) as e:
                log.warning("proxy: tokenize on %s failed: %s: %s", url, type(e).__name__, e)
                # NOTE: the client is told what failed, not the workers' addresses or the errors (the log has them)
                last = ProxyError(503, f"tokenize failed on the model's workers ({min(len(urls), 2)} tried, none "
                                       "answered); retry shortly")
            except ProxyError as e:
                if e.status != 404:
                    raise
                last = e
        assert last is not None
        raise last

    async def _post_tokenize(self, url: str, data: bytes) -> list[int]:
        """The worker's ids for `data`, a /tokenize request body as JSON bytes."""
        self.num_calls += 1
        async with self.http.post(url.rstrip("/") + "/tokenize", data=data, headers=JSON_HEADERS,
                                  timeout=self._timeout) as r:
            raw = await read_capped(r, limit := max_answer_bytes(self.cfg.max_body_bytes))
        if raw is None:  # NOTE: a prompt of n bytes has at most n ids, each at most 8 bytes of JSON
            raise ProxyError(502, f"tokenize: the worker's answer is over {limit} bytes, more than the ids of any "
                                  "prompt the proxy accepts")
        if r.status == 200:
            try:
                return TOKENS.decode(raw).tokens
            except msgspec.DecodeError as e:  # also a ValidationError: no "tokens", or an id that is not an int
                raise ProxyError(502, f"tokenize: the worker's answer is not a list of token ids ({e})") from None
        try:
            doc = ANSWER.decode(raw)
        except msgspec.DecodeError:
            raise ProxyError(502, f"tokenize: the worker answered {r.status} with a body that is not JSON") from None
        err = doc.get("error") if isinstance(doc, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (doc.get("detail") if isinstance(doc, dict) else doc)
        # NOTE: a 404 is the worker's "model does not exist" (an adapter it no longer serves), relayed as such
        raise ProxyError(400 if r.status in (400, 422) else 404 if r.status == 404 else 502, f"tokenize: {msg}")

    def _hf_ids(self, req: dict[str, Any]) -> list[int] | None:
        """The local tokenizer's ids for a /tokenize request; None for a chat left to the workers' /tokenize."""
        tok = self._hf
        if "messages" in req:
            try:
                if (msgs := conversation(req["messages"])) is None:
                    return None
                # NOTE: rendered, then tokenized with the request's add_special_tokens, as vLLM does
                text = tok.apply_chat_template(msgs, tokenize=False, **chat_template_args(req))
            except ProxyError:
                raise  # chat_template_args' own 400, in vLLM's words
            except Exception as e:  # noqa: BLE001 - whatever the local render fails on, the workers' /tokenize answers
                # NOTE: the local render stands in for the workers' /tokenize; a chat it cannot render is theirs to
                # tokenize or refuse, in vLLM's words and status. It raised to the client as the proxy's 500: tool call
                # arguments nested ~1,000 deep (RecursionError; the nesting is inside a string of a shallow body), a
                # request's chat_template that is not a string (TypeError) or does not render (TemplateSyntaxError,
                # raise_exception), a continue_final_message the template cannot honour (ValueError), kwargs such as
                # {"messages": 5} (found probing the local tokenizer's path after a scripts/fuzz_proxy.py run)
                log.debug("proxy: the local tokenizer did not render a chat (%s: %s); asking a worker's /tokenize",
                          type(e).__name__, e)
                return None
            return [int(t) for t in tok.encode(text, add_special_tokens=add_special_tokens(req, chat=True))]
        return [int(t) for t in tok.encode(req["prompt"], add_special_tokens=add_special_tokens(req, chat=False))]
