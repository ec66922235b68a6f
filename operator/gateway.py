"""A MoEDeployment behind a Gateway API Inference Extension gateway (`spec.gateway.inferencePool`, issue #56): the
InferencePool (inference.networking.k8s.io/v1, as of the extension's v1.6.0) and the endpoint picker it names. Pure:
plain dicts in the shape of Kubernetes objects.

    Gateway ─ HTTPRoute ─▶ InferencePool <name>  (selects the router pods, targetPorts: router.httpPort)
                              │ endpointPickerRef
                              ▼
                           Service <name>-epp :eppPort (gRPC, appProtocol http2) ─▶ the router pods' `epp` port
    Service <name>-router-headless (headless, the router pods' HTTP port) ─▶ every picker's `--epp-replicas`

The gateway's Envoy asks the picker (an ext_proc stream: the router's `--epp-port`) which router pod should take each
request; the picker answers with the pod that holds the session's cached prefix (the rendezvous choice the router
replicas make themselves), and Envoy sends the request to that pod's HTTP port. Each picker knows every router
replica through the headless Service's name (`--epp-replicas <name>-router-headless.<namespace>.svc:<httpPort>`,
resolved again at each refresh), so it chooses among all of them even when Envoy sends no subset hint.
"""

from __future__ import annotations

from expertmesh.operator.naming import COMPONENT_ROUTER, object_meta, selector_labels
from expertmesh.operator.spec import MoEDeploymentSpec

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
EPP_PORT_NAME = "epp"
EPP_APP_PROTOCOL = "http2"  # gRPC: the gateway speaks HTTP/2 to the picker


def epp_service_name(name: str) -> str:
    return f"{name}-epp"


def inference_pool_name(name: str) -> str:
    return name


def router_headless_name(name: str) -> str:
    return f"{name}-router-headless"


def epp_replicas(name: str, namespace: str, spec: MoEDeploymentSpec) -> str:
    """The picker's router replicas: the headless Service's DNS name (every router pod's address) on their HTTP
    port."""
    return f"{router_headless_name(name)}.{namespace}.svc:{spec.router.http_port}"


def router_epp_args(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[str]:
    """The router's `--epp-port N --epp-replicas <headless Service>:<httpPort>` when it is the InferencePool's
    endpoint picker; nothing otherwise."""
    g = spec.gateway
    if not g.inference_pool:
        return []
    return ["--epp-port", str(g.epp_port), "--epp-replicas", epp_replicas(name, namespace, spec)]


def router_epp_ports(spec: MoEDeploymentSpec) -> list[dict]:
    """The router container's `epp` port (the picker's gRPC), when it is one."""
    g = spec.gateway
    return [{"name": EPP_PORT_NAME, "containerPort": g.epp_port}] if g.inference_pool else []


def epp_service(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    """Service <name>-epp: the router pods' picker port, the InferencePool's endpointPickerRef."""
    port = spec.gateway.epp_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(epp_service_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, COMPONENT_ROUTER),
            "ports": [
                {
                    "name": EPP_PORT_NAME,
                    "port": port,
                    "targetPort": EPP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": EPP_APP_PROTOCOL,
                }
            ],
        },
    }


def router_headless_service(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    """Service <name>-router-headless: a DNS name resolving to every router pod, the pickers' replica list. Not-ready
    pods are listed too: the picker probes each one's /health itself (what the readiness probe reads), so a replica
    counts the moment it answers, not once the endpoints and DNS have caught up."""
    port = spec.router.http_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(router_headless_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(name, COMPONENT_ROUTER),
            "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def inference_pool(name: str, namespace: str, spec: MoEDeploymentSpec) -> dict:
    """The InferencePool <name>: the router pods (their selector labels) on router.httpPort, the router's picker
    (Service <name>-epp) as its endpoint picker, with the spec's failure mode."""
    g = spec.gateway
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": object_meta(inference_pool_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, COMPONENT_ROUTER)},
            "targetPorts": [{"number": spec.router.http_port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": epp_service_name(name),
                "port": {"number": g.epp_port},
                "failureMode": g.failure_mode,
            },
        },
    }


def gateway_children(name: str, namespace: str, spec: MoEDeploymentSpec) -> list[dict]:
    """The router pods' headless Service, the picker Service and the InferencePool (picker first: the pool names it),
    or nothing."""
    if not spec.gateway.inference_pool:
        return []
    return [
        router_headless_service(name, namespace, spec),
        epp_service(name, namespace, spec),
        inference_pool(name, namespace, spec),
    ]


def absent_gateway_children(name: str, spec: MoEDeploymentSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the gateway objects an earlier spec may have made and this one has not."""
    if spec.gateway.inference_pool:
        return []
    return [
        (INFERENCE_POOL_API, "InferencePool", inference_pool_name(name)),
        ("v1", "Service", epp_service_name(name)),
        ("v1", "Service", router_headless_name(name)),
    ]
