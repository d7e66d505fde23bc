"""The SDK's table (fleet/sdk/table.py) and the two transports that run it, without a server: fake
stubs stand in for the controller's services."""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from fleet.api.kvfleet.v1 import blobs_pb2, route_pb2
from fleet.api.kvfleet.v1 import sessions_pb2 as spb
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.sessions_pb2_grpc import SessionServiceStub
from fleet.core.errors import InvalidArgument, KvfleetError, NotFound, Unauthenticated, Unavailable
from fleet.sdk import AsyncFleetClient, BlobRef, FleetClient, RetryPolicy, base
from fleet.sdk import table as t
from fleet.sdk.sessions import SESSION_TIMEOUT_S

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.0, jitter=0.0, deadline_s=300.0)  # per-attempt deadlines win
SENT_ONCE = {"create_session", "evict", "fork", "admit_tool_result", "close_session", "pin_blob", "unpin_blob",
             "unregister_worker"}  # docs/api.md


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_every_row_is_a_method_of_both_clients_with_its_builders_signature() -> None:
    assert len({r.name for r in t.TABLE}) == len(t.TABLE) == 28
    for rpc in t.TABLE:
        want = list(inspect.signature(rpc.request).parameters.values())
        for cls in (FleetClient, AsyncFleetClient):
            method = getattr(cls, rpc.name)
            assert method.__name__ == rpc.name and method.__doc__ == rpc.request.__doc__
            assert list(inspect.signature(method).parameters.values())[1:] == want
            assert inspect.iscoroutinefunction(method) == (cls is AsyncFleetClient)
    public = {n for n in dir(FleetClient) if not n.startswith("_")}
    assert public == {n for n in dir(AsyncFleetClient) if not n.startswith("_")}
    assert public == {r.name for r in t.TABLE} | {"close"}


def test_only_idempotent_calls_are_retried() -> None:
    assert {r.name for r in t.TABLE if not r.retry} == SENT_ONCE
    assert {r.name for r in t.TABLE if r.timeout == "session"} == {r.name for r in t.TABLE
                                                                  if r.stub is SessionServiceStub}
    assert {(r.name, r.streaming) for r in t.TABLE if r.streaming != "unary"} == {("put_blob", "client"),
                                                                                  ("get_blob", "server")}


def test_builders_validate_before_any_io_and_draw_one_op_id_per_call() -> None:
    with pytest.raises(InvalidArgument, match="token ids"):
        t.route([-1], model="m")
    assert t.route([1, 2], "m", probe=False) == route_pb2.RouteRequest(token_ids=[1, 2], model="m", probe=False)
    a, b = t.APPEND.request("s", "hi"), t.APPEND.request("s", "hi")
    assert a.op_id and b.op_id and a.op_id != b.op_id and a.text == "hi" and a.role == "user"
    assert t.GENERATE.request("s", 4, op_id="turn-7").op_id == "turn-7"
    with pytest.raises(InvalidArgument, match="op_id must be a str"):
        t.ADD_TOOL_RESULT.request("s", "ab" * 32, op_id=7)  # type: ignore[arg-type]


def test_a_put_stream_is_opened_afresh_for_each_attempt() -> None:
    data = b"x" * (base.CHUNK + 5)
    req = t.PUT_BLOB.request(data)
    first, second = list(t.PUT_BLOB.wire(req)), list(t.PUT_BLOB.wire(req))
    assert first == second and len(first) == 3
    assert first[0].header.size == len(data) and first[0].header.expected_ref == hashlib.sha256(data).hexdigest()
    assert t.PUT_BLOB.request(data, verify=False)().__next__().header.expected_ref == ""


# -- both transports against fake stubs ------------------------------------------------------------

class FakeBlobs:
    """BlobService: each method fails with the queued statuses first, then answers."""

    def __init__(self, fails: list[grpc.StatusCode], data: bytes, aio: bool) -> None:
        self.fails, self.data, self.aio = list(fails), data, aio
        self.calls: list[tuple[str, float]] = []

    def _attempt(self, method: str, timeout: float) -> None:
        self.calls.append((method, timeout))
        if self.fails:
            code = self.fails.pop(0)
            raise Status(code, f"{method}: {code.name.lower()}")

    def PutBlob(self, requests: Iterator[blobs_pb2.PutBlobRequest], *, timeout: float, metadata: Any) -> Any:
        msgs = list(requests)  # the stream is read before the answer (or the failure)
        self._attempt("PutBlob", timeout)
        got = b"".join(m.chunk for m in msgs[1:])
        assert hashlib.sha256(got).hexdigest() == msgs[0].header.expected_ref
        return self._reply(blobs_pb2.PutBlobResponse(ref=msgs[0].header.expected_ref, size=len(got)))

    def GetBlob(self, req: blobs_pb2.GetBlobRequest, *, timeout: float, metadata: Any) -> Any:
        chunks = [blobs_pb2.GetBlobResponse(chunk=self.data[i:i + 4]) for i in range(0, len(self.data), 4)]
        if not self.aio:
            self._attempt("GetBlob", timeout)
            return iter(chunks)

        async def stream() -> AsyncIterator[blobs_pb2.GetBlobResponse]:
            self._attempt("GetBlob", timeout)
            for c in chunks:
                yield c
        return stream()

    def _reply(self, r: Any) -> Any:
        if not self.aio:
            return r

        async def answer() -> Any:
            return r
        return answer()


class FakeSessions(FakeBlobs):
    def CreateSession(self, req: spb.CreateSessionRequest, *, timeout: float, metadata: Any) -> Any:
        self._attempt("CreateSession", timeout)
        return self._reply(spb.CreateSessionResponse(session=spb.SessionRow(session_id=req.session_id)))

    def GetSession(self, req: spb.GetSessionRequest, *, timeout: float, metadata: Any) -> Any:
        self._attempt("GetSession", timeout)
        return self._reply(spb.GetSessionResponse(session=spb.SessionRow(session_id=req.session_id)))

    def Append(self, req: spb.AppendRequest, *, timeout: float, metadata: Any) -> Any:
        self._attempt(f"Append {req.op_id}", timeout)
        return self._reply(spb.AppendResponse(num_tokens=len(req.text), op_index=3))

    def Generate(self, req: spb.GenerateRequest, *, timeout: float, metadata: Any) -> Any:
        self._attempt(f"Generate {req.op_id}", timeout)
        return self._reply(spb.GenerateResponse(token_ids=[7] * req.num_tokens))


def client(cls: type[Any], fake: FakeBlobs, retry: RetryPolicy = FAST) -> Any:
    c = cls("127.0.0.1:1", token="kvf_t", retry=retry, timeout=7.0, blob_timeout=60.0)
    c._stubs.update({BlobServiceStub: fake, SessionServiceStub: fake})
    return c


async def drive(cls: type[Any], fails: list[grpc.StatusCode], call: str, *args: Any, data: bytes = b"",
                retry: RetryPolicy = FAST, **kwargs: Any) -> tuple[Any, FakeSessions]:
    fake = FakeSessions(fails, data, aio=cls is AsyncFleetClient)
    c = client(cls, fake, retry)
    try:
        out = getattr(c, call)(*args, **kwargs)
        return (await out if fake.aio else out), fake
    finally:
        await c.close() if fake.aio else c.close()


CLIENTS = pytest.mark.parametrize("cls", [FleetClient, AsyncFleetClient])
U, NF, D = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED


@CLIENTS
async def test_unavailable_is_retried_with_a_fresh_stream_each_attempt(cls: type[Any]) -> None:
    ref, fake = await drive(cls, [U, U], "put_blob", b"tool output")
    assert ref == BlobRef(hashlib.sha256(b"tool output").hexdigest(), 11)
    assert fake.calls == [("PutBlob", 60.0)] * 3


@CLIENTS
async def test_a_server_stream_is_read_whole_and_checked(cls: type[Any]) -> None:
    data = b"0123456789abcdef!"
    ref = hashlib.sha256(data).hexdigest()
    got, fake = await drive(cls, [U], "get_blob", ref, data=data)
    assert got == data and fake.calls == [("GetBlob", 60.0)] * 2
    with pytest.raises(KvfleetError, match="arrived corrupted"):
        await drive(cls, [], "get_blob", "ab" * 32, data=data)
    assert (await drive(cls, [], "get_blob", "ab" * 32, data=data, verify=False))[0] == data


@CLIENTS
async def test_other_statuses_are_raised_at_once_as_fleet_errors(cls: type[Any]) -> None:
    with pytest.raises(NotFound, match="GetBlob: not_found"):
        await drive(cls, [NF, U], "get_blob", "ab" * 32)


@CLIENTS
async def test_exhausted_retries_raise_unavailable_naming_the_attempts(cls: type[Any]) -> None:
    with pytest.raises(Unavailable, match=r"PutBlob: controller at 127.0.0.1:1 unavailable after 4 attempt"):
        await drive(cls, [U] * 9, "put_blob", b"x")


@CLIENTS
async def test_an_append_keeps_its_op_id_across_retries(cls: type[Any]) -> None:
    r, fake = await drive(cls, [U, U], "append", "s1", "hello")
    assert (r.num_tokens, r.op_index, r.piece) == (5, 3, None)
    assert len({m for m, _ in fake.calls}) == 1 and len(fake.calls) == 3
    assert fake.calls[0][1] == SESSION_TIMEOUT_S


@CLIENTS
async def test_the_first_attempt_has_its_whole_deadline_and_the_error_names_the_setting_that_cut_it(
        cls: type[Any]) -> None:
    # Found by review: each attempt had min(per-attempt deadline, retry deadline left), so a retried session call
    # (session_timeout 120 s) was cut at RetryPolicy.deadline_s (30 s), and its error said to raise session_timeout,
    # which changed nothing. Before the fix the first attempt of each call here had 5.0 s, not 120 (or 60).
    short = RetryPolicy(max_attempts=4, initial_backoff_s=0.0, jitter=0.0, deadline_s=5.0)
    with pytest.raises(Unavailable, match=r"^GetSession at 127.0.0.1:1: deadline exceeded after 120.0s; .*raise the "
                                          r"client's session_timeout \(per attempt: 120s\)") as ei:
        await drive(cls, [D], "get_session", "s1", retry=short)
    assert "deadline_s" not in str(ei.value)
    fake = FakeSessions([U, D], b"", aio=cls is AsyncFleetClient)
    c = client(cls, fake, short)
    try:  # a retry runs only until the retry deadline: its error names deadline_s
        with pytest.raises(Unavailable, match=r"deadline exceeded after [45]\.\d+s \(attempt 2\); .*what was left "
                                              r"of RetryPolicy.deadline_s \(5s from the call's first attempt\): raise "
                                              "deadline_s"):
            out = c.get_blob("ab" * 32)
            await out if fake.aio else None
    finally:
        await c.close() if fake.aio else c.close()
    assert fake.calls[0] == ("GetBlob", 60.0) and 4.0 < fake.calls[1][1] <= 5.0
    row, fake = await drive(cls, [], "get_session", "s1", retry=short)  # control: an answer within it
    assert row.row.session_id == "s1" and fake.calls == [("GetSession", SESSION_TIMEOUT_S)]


@CLIENTS
async def test_a_timed_out_call_with_an_op_id_is_retried_under_it_and_its_error_carries_it(cls: type[Any]) -> None:
    # Found by review: an append cut off by the client's deadline is still applied by the controller (it finishes a
    # call its caller stopped waiting for: controller/sessions.py _settled), and the SDK raised Unavailable without
    # the op id it drew, so the user's own retry (a new call: a new op id) applied it twice. Before the fix the first
    # drive raised Unavailable ("deadline exceeded") after one attempt.
    r, fake = await drive(cls, [D, D], "append", "s1", "hello")
    assert r.num_tokens == 5 and len(fake.calls) == 3 and len({m for m, _ in fake.calls}) == 1  # one op id
    with pytest.raises(Unavailable) as ei:  # no retry left: the op id to finish it with is on the error
        await drive(cls, [D], "generate", "s1", 2, op_id="turn-7", retry=RetryPolicy(max_attempts=1))
    assert ei.value.op_id == "turn-7"
    assert re.search(r"^Generate at 127.0.0.1:1: deadline exceeded after 120.0s; .*The op may have been applied: call "
                     r"again with op_id='turn-7' .*replayed=True\), never applied twice$", str(ei.value)), ei.value
    with pytest.raises(Unavailable, match="after 4 attempt.*op_id='t-9'") as ei:  # UNAVAILABLEs ran out (a torn op)
        await drive(cls, [U] * 9, "add_tool_result", "s1", "ab" * 32, op_id="t-9")
    assert ei.value.op_id == "t-9"
    with pytest.raises(NotFound) as nf:  # refused, so not applied: it carries the op id, and says nothing more
        await drive(cls, [NF], "append", "s1", "x", op_id="t-1")
    assert nf.value.op_id == "t-1" and str(nf.value) == "Append t-1: not_found"
    with pytest.raises(Unavailable, match="deadline exceeded") as ei:  # control: a read has no op id, is not retried
        await drive(cls, [D, D], "get_session", "s1")
    assert ei.value.op_id == ""


@CLIENTS
async def test_a_call_sent_once_is_not_retried(cls: type[Any]) -> None:
    unreachable = r"^CreateSession: the controller at 127.0.0.1:1 is unreachable \(CreateSession: unavailable\)$"
    with pytest.raises(Unavailable, match=unreachable) as ei:  # no controller answered it (no kvfleet-error trailer)
        await drive(cls, [U], "create_session", "s1", "sys")
    assert "attempt" not in str(ei.value)
    row, fake = await drive(cls, [], "create_session", "s1", "sys")
    assert row.session_id == "s1" and fake.calls == [("CreateSession", SESSION_TIMEOUT_S)]


BAD_ARGUMENTS = {  # message -> a call; each was a raw TypeError or UnicodeEncodeError from protobuf before
    "session_id must be a str, got int 123": lambda c: c.create_session(123, "sys"),
    "role must be a str, got int 5": lambda c: c.append("s1", "hi", role=5),
    "model must be a str, got int 5": lambda c: c.route([1, 2], model=5),
    "child_id must be a str, got NoneType": lambda c: c.fork("s1", None),
    "name must be a str, got bytes": lambda c: c.lifecycle(b"w0", "sleep"),
    r"append's text is not valid Unicode: '\\ud83d' at character 11 is a lone surrogate": lambda c: c.append(
        "s1", "tool said: \ud83d"),
    "system_prompt is not valid Unicode": lambda c: c.create_session("s1", "bytes \udcff"),
    "tags is not valid Unicode": lambda c: c.lifecycle("w0", "wake_up", tags=["\udc80"]),
    "op_id is not valid Unicode": lambda c: c.generate("s1", 2, op_id="t-\ud800"),
    # what no check names: protobuf's refusal, as InvalidArgument naming the call
    r"get_session: an argument does not fit its request \(TypeError: 'str' object cannot be interpreted": lambda c:
        c.get_session("s1", include_tokens="yes"),
}


@CLIENTS
async def test_arguments_protobuf_refuses_are_invalid_argument_naming_them(cls: type[Any]) -> None:
    # Found by review: a non-str id, role or model raised protobuf's TypeError ("bad argument type for built-in
    # operation"), a lone surrogate in a text its UnicodeEncodeError. Before the fix this failed at its first call.
    c = cls("127.0.0.1:1", retry=RetryPolicy(max_attempts=1))  # nothing listens: a call that got past its checks
    try:                                                       # would raise Unavailable, not InvalidArgument
        for message, call in BAD_ARGUMENTS.items():
            with pytest.raises(InvalidArgument, match=message):
                out = call(c)
                await out if cls is AsyncFleetClient else None
        with pytest.raises(TypeError, match="missing a required argument|required positional argument"):
            out = c.append("s1")  # type: ignore[call-arg]  # a wrong signature stays a TypeError
            await out if cls is AsyncFleetClient else None
    finally:
        await c.close() if cls is AsyncFleetClient else c.close()


@pytest.mark.parametrize("token", ["kvf_abc\n", " kvf_abc", "kvf_a\tbc", "kvf_é"])
def test_a_token_that_cannot_be_a_header_is_unauthenticated_at_once(token: str) -> None:
    # Found by review: a token read from a file with its newline failed every call with INTERNAL "Invalid metadata".
    # Before the fix the client was made and no error was raised here.
    with pytest.raises(Unauthenticated, match=r"a bearer token is visible ASCII only .*strip\(\) it"):
        FleetClient("127.0.0.1:1", token=token)
    with pytest.raises(Unauthenticated, match="the token must be a str, got bytes"):
        AsyncFleetClient("127.0.0.1:1", token=b"kvf_abc")  # type: ignore[arg-type]
    FleetClient("127.0.0.1:1", token="kvf_abc").close()  # control: visible ASCII is a header


@pytest.mark.parametrize("token", ["Bearer kvf_abc", "bearer kvf_abc"])
def test_a_token_given_with_its_bearer_prefix_says_to_drop_it(token: str) -> None:
    # Found by review: "Bearer kvf_..." (the header's value, copied whole) was told to strip() the token, which
    # keeps the prefix
    with pytest.raises(Unauthenticated, match="pass the token alone"):
        FleetClient("127.0.0.1:1", token=token)
    with pytest.raises(Unauthenticated, match="strip\\(\\) it"):  # control: another space keeps its advice
        FleetClient("127.0.0.1:1", token="kvf_abc ")
