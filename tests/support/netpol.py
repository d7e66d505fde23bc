"""Who may reach a pod's port under rendered NetworkPolicies: Kubernetes' ingress rules, evaluated.

A pod that no policy with Ingress selects admits everything; a selected pod admits a connection that
one rule of one of those policies allows. A rule with no `from` admits every source, one with no
`ports` every port. A `from` peer with only a podSelector means pods of the policy's namespace, with a
namespaceSelector pods of the namespaces it selects (all of them under its podSelector, if any). An
ipBlock peer never matches a pod here (pod IPs are not modelled). Named ports resolve through the
target's container ports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Pod:
    labels: dict[str, str]
    namespace: str
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # named container ports

    def __post_init__(self) -> None:
        assert self.namespace


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); {} selects everything."""
    sel = selector or {}
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], src: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        in_ns = selects(peer["namespaceSelector"], src.namespace_labels)
    else:
        in_ns = src.namespace == policy_ns
    return in_ns and selects(peer.get("podSelector"), src.labels)


def _port_matches(entry: dict[str, Any], target: Pod, port: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    want = entry.get("port")
    if want is None:
        return True
    if isinstance(want, str):
        return target.ports.get(want) == port
    return want <= port <= entry.get("endPort", want)


def admits(policies: list[dict[str, Any]], target: Pod, src: Pod, port: int) -> bool:
    """Whether `src` may open a TCP connection to `target` on `port` under `policies` (all in target's namespace)."""
    mine = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
            and p.get("metadata", {}).get("namespace", target.namespace) == target.namespace
            and selects(p["spec"]["podSelector"], target.labels)]
    if not mine:
        return True
    for p in mine:
        for rule in p["spec"].get("ingress") or []:
            peers, ports = rule.get("from"), rule.get("ports")
            ok_peer = not peers or any(_peer_matches(f, src, target.namespace) for f in peers)
            ok_port = not ports or any(_port_matches(q, target, port) for q in ports)
            if ok_peer and ok_port:
                return True
    return False
