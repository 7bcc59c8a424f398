"""The checks of the Pod Security Standards' `baseline` and `restricted` levels that a pod spec can fail
(kubernetes.io/docs/concepts/security/pod-security-standards, v1.30), as plain functions: no library
implements Pod Security admission outside the API server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                  "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def baseline_violations(spec: Mapping[str, Any]) -> list[str]:
    found = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    found += [f"hostPath volume {v['name']}" for v in spec.get("volumes") or () if "hostPath" in v]
    for c in _containers(spec):
        ctx = c.get("securityContext") or {}
        if ctx.get("privileged"):
            found.append(f"{c['name']}: privileged")
        added = set((ctx.get("capabilities") or {}).get("add") or ())
        if added - _BASELINE_CAPS:
            found.append(f"{c['name']}: adds capabilities {sorted(added - _BASELINE_CAPS)}")
        if any(p.get("hostPort") for p in c.get("ports") or ()):
            found.append(f"{c['name']}: hostPort")
    return found


def restricted_violations(spec: Mapping[str, Any], containers: list[str] | None = None) -> list[str]:
    """Violations of `restricted` (which includes `baseline`); `containers` limits the per-container
    checks to those names (the injected parts of a pod whose own containers are the user's)."""
    found = baseline_violations(spec)
    found += [f"volume {v['name']} of a type restricted forbids" for v in spec.get("volumes") or ()
              if not set(v) - {"name"} <= _RESTRICTED_VOLUMES]
    pod = spec.get("securityContext") or {}
    for c in _containers(spec):
        if containers is not None and c["name"] not in containers:
            continue
        ctx = c.get("securityContext") or {}
        name = c["name"]
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if not ctx.get("runAsNonRoot", pod.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot must be true")
        if ctx.get("runAsUser", pod.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            found.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: may add only NET_BIND_SERVICE")
    return found
