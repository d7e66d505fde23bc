"""The TLS Secrets docs/deploy.md §8 tells you to create, mounted as the rendered chart mounts them: the proxy and
the controller find every file their TLS flags name, and the proxy loads them (its own config check, on real PEM).

NOTE: before, §8 made the server Secret with `kubectl create secret tls` (tls.crt and tls.key only, no ca.crt).
The proxy's `--tls-ca /etc/kvfleet/tls/ca.crt` (an optional item: the mount succeeds without it) then named a
missing file, and every proxy pod stopped at start ("--tls-ca ... does not load (No such file ...)"); with mutual
TLS the controller's `--tls-client-ca` named the same missing file.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from test_chart import NAMESPACE, RELEASE, ROOT, _docs, container, one

from controller.proxy.main import config_from, parse_args

SERVER = {"tls": {"enabled": True, "secretName": "kvfleet-tls"}}
MUTUAL = {"tls": {"enabled": True, "secretName": "kvfleet-tls", "clientCa": True, "clientSecretName": "kvfleet-client"}}


def doc_secrets(text: str) -> dict[str, set[str]]:
    """{Secret name: its keys} for each `kubectl create secret` in the TLS section's shell blocks, as kubectl makes
    them: `secret tls` holds tls.crt and tls.key; `--from-file=[KEY=]PATH` adds KEY (else PATH's file name)."""
    section = text.split("## 8. TLS", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#", 1)[0])
            if words[:1] != ["kubectl"] or "secret" not in words:
                continue
            kind, name = words[words.index("secret") + 1: words.index("secret") + 3]
            keys = {"tls.crt", "tls.key"} if kind == "tls" else set()
            for w in words:
                if w.startswith("--from-file="):
                    spec = w.split("=", 1)[1]
                    keys.add(spec.split("=", 1)[0] if "=" in spec else Path(spec).name)
            out[name] = keys
    return out


def mount(pod: dict[str, Any], c: dict[str, Any], secrets: dict[str, set[str]], root: Path, pem: dict[str, bytes]) -> None:
    """The container's Secret volumes as the kubelet mounts them under `root`: only keys the Secret holds (an item
    marked optional and missing is skipped; one not optional would keep the pod from starting)."""
    vols = {v["name"]: v["secret"] for v in pod["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    for m in c["volumeMounts"]:
        if m["name"] not in vols or vols[m["name"]]["secretName"] not in secrets:
            continue
        s = vols[m["name"]]
        keys = secrets[s["secretName"]]
        items = s.get("items") or [{"key": k, "path": k} for k in keys]
        for it in items:
            assert it["key"] in keys or s.get("optional"), f"{c['name']}: Secret {s['secretName']} has no {it['key']}"
            if it["key"] in keys:
                f = root / m["mountPath"].lstrip("/") / it["path"]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(pem[it["key"]])


def _pem(d: Path) -> dict[str, bytes]:
    """One self-signed certificate (its own CA) and its key: enough for the proxy's loads."""
    d.mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvfleet",
                    "-keyout", str(d / "k.pem"), "-out", str(d / "c.pem")], check=True, capture_output=True)
    cert, key = (d / "c.pem").read_bytes(), (d / "k.pem").read_bytes()
    return {"tls.crt": cert, "tls.key": key, "ca.crt": cert}


def _files(args: list[str], flags: tuple[str, ...]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a in flags}


def check(chart: Any, values: dict[str, Any], secrets: dict[str, set[str]], tmp: Path) -> None:
    objs = _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))
    pem = _pem(tmp)
    for comp in ("controller", "proxy"):
        dep = one(objs, "Deployment", f"-{comp}")
        c = container(dep)
        root = tmp / comp
        mount(dep, c, secrets, root, pem)
        files = _files(c["args"], ("--tls-ca", "--tls-cert", "--tls-key", "--tls-client-ca"))
        assert files, comp
        for flag, path in files.items():
            assert (root / path.lstrip("/")).is_file(), f"{comp} {flag} {path}: not in the mounted Secrets {secrets}"
        if comp == "proxy":  # the proxy's own start-up check: every file loads
            args = [str(root / a.lstrip("/")) if a in files.values() else a for a in c["args"][1:]]
            assert config_from(parse_args(args, {})).credentials() is not None


def test_the_documented_tls_secrets_start_the_proxy_and_controller(chart: Any, tmp_path: Path) -> None:
    secrets = doc_secrets((ROOT / "docs" / "deploy.md").read_text())
    assert {"kvfleet-tls", "kvfleet-client"} <= set(secrets), secrets
    check(chart, SERVER, secrets, tmp_path / "server")
    check(chart, MUTUAL, secrets, tmp_path / "mutual")


def test_a_server_secret_without_ca_crt_stops_the_proxy(chart: Any, tmp_path: Path) -> None:
    """Control: the Secret `kubectl create secret tls` makes (no ca.crt) fails the same check."""
    import pytest

    from fleet.core.errors import InvalidArgument

    bare = {"kvfleet-tls": {"tls.crt", "tls.key"}, "kvfleet-client": {"tls.crt", "tls.key"}}
    with pytest.raises(AssertionError, match="proxy --tls-ca /etc/kvfleet/tls/ca.crt: not in the mounted"):
        check(chart, SERVER, bare, tmp_path / "server")
    with pytest.raises(AssertionError, match="controller --tls-client-ca"):
        check(chart, MUTUAL, bare, tmp_path / "mutual")
    # and the proxy itself refuses to start on it
    objs = _docs(chart.render(SERVER, name=RELEASE, namespace=NAMESPACE))
    args = container(one(objs, "Deployment", "-proxy"))["args"][1:]
    args[args.index("--tls-ca") + 1] = str(tmp_path / "absent" / "ca.crt")
    with pytest.raises(InvalidArgument, match="does not load"):
        config_from(parse_args(args, {})).credentials()
