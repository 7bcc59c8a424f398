"""RBAC as the API server evaluates it, for checking the operator's recorded API calls against the
chart's rendered rules (kmock, which stands in for the API server, authorises nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Request:
    """What the API server authorises a request as."""

    group: str
    resource: str  # with its subresource: marucaches/status
    verb: str
    namespace: str | None  # None: a cluster-scoped object, or every namespace
    name: str | None


def parse_request(method: str, path: str, query: Mapping[str, str]) -> Request | None:
    """The request `method path?query` as RBAC sees it; None for discovery and non-resource URLs."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1] if len(parts) > 1 else "", parts[3:]
    else:
        return None  # /version, /healthz: non-resource URLs every authenticated user may read
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    name = rest[1] if len(rest) > 1 else None
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if name else "deletecollection"}.get(method, "")
    if method == "GET":
        verb = "watch" if query.get("watch") in ("true", "1") else "get" if name else "list"
    return Request(group, resource, verb, namespace, name)


def rbac_request(method: str, path: str, query: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) a request is authorised as; None for discovery."""
    request = parse_request(method, path, query)
    return None if request is None else (request.group, request.resource, request.verb)


def _matches(rule: Mapping[str, Any], request: Request) -> bool:
    names = rule.get("resourceNames")
    return (request.group in rule["apiGroups"] and request.resource in rule["resources"]
            and request.verb in rule["verbs"] and (not names or request.name in names))


class Authorizer:
    """The rules granted to one ServiceAccount by the rendered `docs`: a ClusterRole bound by a
    ClusterRoleBinding applies everywhere; a Role bound by a RoleBinding only in its namespace (never
    to a cluster-scoped object or a list across namespaces); `resourceNames` limit a rule to those
    objects (so never to a create or a list)."""

    def __init__(self, docs: Iterable[Mapping[str, Any]], account_namespace: str, account: str) -> None:
        docs = list(docs)
        subject = {"kind": "ServiceAccount", "name": account, "namespace": account_namespace}
        roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
                 for d in docs if d["kind"] in ("Role", "ClusterRole")}
        # (namespace the rule applies in, None: everywhere; rule)
        self.rules: list[tuple[str | None, dict[str, Any]]] = []
        for binding in docs:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or subject not in binding["subjects"]:
                continue
            namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
            ref = binding["roleRef"]
            role = roles[(ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"])]
            self.rules += [(namespace, rule) for rule in role["rules"]]

    def allows(self, request: Request) -> bool:
        return any(_matches(rule, request) for namespace, rule in self.rules
                   if namespace is None or namespace == request.namespace)

    def granted(self) -> set[tuple[str, str, str]]:
        """Every (apiGroup, resource, verb) some rule grants, somewhere."""
        return {(g, r, v) for _, rule in self.rules for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}
