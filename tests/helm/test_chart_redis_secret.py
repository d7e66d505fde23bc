"""Your own Redis's URL, password included, is rendered nowhere but in a Secret: the controller reads it as
KVFLEET_STORE from the chart's Secret (redis.external.url) or yours (redis.external.existingSecret), never from
--store, and NOTES.txt shows it without its credentials.

NOTE: before, redis.external.url went verbatim into the controller Deployment's arguments (readable by anyone who
may read Deployments, and in `kubectl describe`, `ps` on the node, audit logs) and into NOTES.txt.
"""

from __future__ import annotations

import base64
from typing import Any

import helm_python as helm
import pytest
from test_chart import NAMESPACE, RELEASE, _docs, container, one

from controller.main import parse_args

PW = "S3cr3tRedisPw"
URLS = [
    f"redis://default:{PW}@redis-master.db.svc:6379/0",
    f"rediss://user-{PW}:{PW}@redis.db:6380/1",
    f"redis://:{PW}@@db:6379/0",  # forms the schema refuses but redis-py reads a password from:
    f"redis://db:6379/0?password={PW}",  # rendered with the schema skipped
    f"unix://:{PW}@/var/run/redis.sock?db=0",
]
SHOWN = ["redis://***@redis-master.db.svc:6379/0", "rediss://***@redis.db:6380/1", "redis://***@db:6379/0",
         "redis://db:6379/0?…", "unix://***@/var/run/redis.sock?…"]


def _controller_env(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e for e in container(one(objs, "Deployment", "-controller"))["env"]}


@pytest.mark.parametrize(("url", "shown"), list(zip(URLS, SHOWN, strict=True)))
def test_a_url_with_a_password_is_rendered_only_into_the_charts_secret(
        chart: Any, chart_without_schema: Any, url: str, shown: str) -> None:
    values = {"redis": {"create": False, "external": {"url": url}}}
    schema_takes_it = "@@" not in url and "?" not in url
    out = (chart if schema_takes_it else chart_without_schema).render(values, name=RELEASE, namespace=NAMESPACE)
    encoded = base64.b64encode(url.encode()).decode()
    for path, text in out.items():
        assert PW not in text, path
        assert (encoded in text) == path.endswith("secret-redis-url.yaml"), path
    notes = out["kvfleet/templates/NOTES.txt"]
    print(notes.splitlines()[2])
    assert f"Store: {shown} (your Redis; the URL is in Secret demo-kvfleet-redis-url)" in notes
    objs = _docs(out)
    secret = one(objs, "Secret", "-redis-url")
    assert base64.b64decode(secret["data"]["url"]).decode() == url
    args = container(one(objs, "Deployment", "-controller"))["args"]
    env = _controller_env(objs)["KVFLEET_STORE"]
    assert "--store" not in args
    assert env["valueFrom"]["secretKeyRef"] == {"name": "demo-kvfleet-redis-url", "key": "url"}
    # the controller takes its store from KVFLEET_STORE when no --store is given (a --store would win)
    assert parse_args(args[1:], {"KVFLEET_STORE": url}).store == url
    assert parse_args([*args[1:], "--store", "redis://x:6379/0"], {"KVFLEET_STORE": url}).store == "redis://x:6379/0"


def test_an_existing_secret_is_read_and_none_is_made(chart: Any) -> None:
    values = {"redis": {"create": False, "external": {"existingSecret": "my-redis", "existingSecretKey": "uri"}}}
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objs = _docs(out)
    assert not [o for o in objs if o["metadata"]["name"].endswith(("-redis", "-redis-url"))]
    assert _controller_env(objs)["KVFLEET_STORE"]["valueFrom"]["secretKeyRef"] == {"name": "my-redis", "key": "uri"}
    assert "--store" not in container(one(objs, "Deployment", "-controller"))["args"]
    assert "Store: your Redis, its URL in Secret my-redis (key uri)" in out["kvfleet/templates/NOTES.txt"]


def test_the_charts_own_redis_keeps_store_and_gets_no_env(chart: Any) -> None:
    objs = _docs(chart.render({}, name=RELEASE, namespace=NAMESPACE))
    args = container(one(objs, "Deployment", "-controller"))["args"]
    assert args[args.index("--store") + 1] == "redis://demo-kvfleet-redis:6379/0"
    assert "KVFLEET_STORE" not in _controller_env(objs)
    assert not [o for o in objs if o["metadata"]["name"].endswith("-redis-url")]


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"create": False, "external": {"url": f"redis://:{PW}@db:6379/0", "existingSecret": "my-redis"}}},
     "redis.external.url and redis.external.existingSecret are both set"),
    ({"redis": {"external": {"existingSecret": "my-redis"}}}, "redis.external.existingSecret is set but redis.create=true"),
    ({"redis": {"create": False}}, "redis.create=false needs redis.external.url (redis://HOST:PORT/DB) or "
                                   "redis.external.existingSecret"),
])
def test_templates_refuse_ambiguous_stores_without_showing_the_url(
        chart_without_schema: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        chart_without_schema.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(e.value) and PW not in str(e.value)


@pytest.mark.parametrize(("values", "where"), [
    ({"redis": {"create": False, "external": {"existingSecret": "My_Secret"}}}, "/redis/external/existingSecret"),
    ({"redis": {"create": False, "external": {"existingSecret": "s", "existingSecretKey": ""}}},
     "/redis/external/existingSecretKey"),
    ({"redis": {"create": False}}, "/redis/external/existingSecret"),  # neither url nor existingSecret
])
def test_schema_refuses_bad_secret_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert f"at '{where}'" in str(e.value)
