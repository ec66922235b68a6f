"""The restricted Pod Security Standard as a checker: the rules of the Kubernetes documentation's "Pod Security
Standards" page (the Baseline policy, and Restricted on top of it), each applied to a pod spec as the admission
controller `PodSecurity` in `enforce: restricted` mode applies it. `violations(pod_spec, annotations)` → what breaks
a rule (empty: the pod is admitted).

Baseline: no HostProcess, no host namespaces (network, PID, IPC), no privileged container, capabilities added only
from the baseline list, no hostPath volume, no host port, AppArmor only the runtime's default or a localhost profile,
SELinux only the container types (no custom user or role), the default /proc mount, seccomp not Unconfined, sysctls
only from the safe set. Restricted: volumes only configMap, csi, downwardAPI, emptyDir, ephemeral,
persistentVolumeClaim, projected and secret; allowPrivilegeEscalation false in every container; runAsNonRoot true (the
pod's, or every container's), runAsUser never 0; seccomp RuntimeDefault or Localhost (the pod's, or every
container's); every container drops ALL capabilities and adds at most NET_BIND_SERVICE. "Every container" counts
containers, initContainers and ephemeralContainers.
"""

from __future__ import annotations

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}
APPARMOR_OK = {"RuntimeDefault", "Localhost"}


def containers(pod: dict) -> list[dict]:
    return [*(pod.get("containers") or []), *(pod.get("initContainers") or []), *(pod.get("ephemeralContainers") or [])]


def violations(pod: dict, annotations: dict | None = None) -> list[str]:
    """Every rule of the restricted profile (Baseline included) that `pod` (a pod spec) breaks, one line each."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    all_containers = containers(pod)

    def each(sc: dict, where: str) -> None:  # the rules read alike at pod and container level
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor is not None and apparmor not in APPARMOR_OK:
            out.append(f"{where}: appArmorProfile {apparmor}")
        if sc.get("runAsNonRoot") is False:
            out.append(f"{where}: runAsNonRoot false")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")

    # ---- baseline
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(ns):
            out.append(f"pod: {ns}")
    each(psc, "pod.securityContext")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl.get('name')}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"pod: AppArmor annotation {key}={value}")
    for vol in pod.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if "hostPath" in kinds:
            out.append(f"volume {vol['name']}: hostPath {vol['hostPath'].get('path')}")
        elif not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    for c in all_containers:
        where = f"container {c.get('name')}"
        sc = c.get("securityContext") or {}
        each(sc, where)
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"{where}: capabilities added beyond the baseline {sorted(added - BASELINE_CAPABILITIES)}")
        # ---- restricted, per container
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities do not drop ALL")
        if added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities added beyond NET_BIND_SERVICE {sorted(added - {'NET_BIND_SERVICE'})}")
    # ---- restricted, pod or every container
    if psc.get("runAsNonRoot") is not True and not all(
        (c.get("securityContext") or {}).get("runAsNonRoot") is True for c in all_containers
    ):
        out.append("pod: runAsNonRoot is not true (neither the pod's nor every container's)")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for c in all_containers:
        theirs = ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        if (theirs or pod_seccomp) not in SECCOMP_OK:
            out.append(
                f"container {c.get('name')}: seccomp profile {theirs or pod_seccomp} (RuntimeDefault or Localhost)"
            )
    return out


def pod_templates(children: list[dict]) -> list[tuple[str, dict, dict]]:
    """(kind/name, pod spec, pod annotations) of every pod template among `children` (workloads and Jobs, a CronJob's
    job template, bare Pods)."""
    out = []
    for c in children:
        name = f"{c['kind']}/{c['metadata']['name']}"
        if c["kind"] == "Pod":
            out.append((name, c["spec"], c["metadata"].get("annotations") or {}))
            continue
        spec = c.get("spec") or {}
        if c["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            tmpl = spec["template"]
            out.append((name, tmpl["spec"], (tmpl.get("metadata") or {}).get("annotations") or {}))
    return out
