"""The operator's Kubernetes API edge: lightkube's AsyncClient, plus the little the handlers need that it lacks.

lightkube does the work: configuration as kubectl (service account, KUBECONFIG, exec plugins), typed models for the
builtin kinds (`codecs.from_dict` loads a child dict into one by its apiVersion and kind), server-side apply,
pods/log, and generic resources for MoEDeployment and the other projects' kinds it renders (InferencePool,
LeaderWorkerSet, ComputeDomain: registered below, so they are found by kind like the others). This
module adds only:
  - plain dicts in and out (the currency of the pure modules);
  - a (connect, read) deadline on every call, and one client per event loop (a connection pool belongs to its loop);
  - one error type, `KubeError`, carrying the HTTP status (None: no response) and whether a retry may help;
  - `get` → None for a missing object, `apply` falling back to create where the server does not know the object
    (an API without server-side apply answers 404), `create_once` keeping an object that exists (409), `delete`
    → False for a missing one.
"""

from __future__ import annotations

import asyncio
import weakref

import httpx2 as httpx  # lightkube's HTTP client
from lightkube import ApiError, AsyncClient, KubeConfig, codecs
from lightkube.config.models import Cluster, User
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType

from expertmesh.operator.spec import GROUP, KIND, PLURAL, VERSION

FIELD_MANAGER = "expertmesh-operator"
API_TIMEOUT = (5.0, 30.0)  # (connect, read) seconds for every Kubernetes call
MoEDeployment = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
# the other projects' kinds a MoEDeployment may have as children (issue #56): found by kind like the builtin ones
InferencePool = create_namespaced_resource("inference.networking.k8s.io", "v1", "InferencePool", "inferencepools")
LeaderWorkerSet = create_namespaced_resource("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets")
ComputeDomain = create_namespaced_resource("resource.nvidia.com", "v1beta1", "ComputeDomain", "computedomains")


class KubeError(Exception):
    def __init__(self, status: int | None, message: str):
        super().__init__(f"{status or 'no response'}: {message}")
        self.status = status

    @property
    def transient(self) -> bool:
        """Worth retrying: no response, throttled, conflict, server-side trouble."""
        return self.status is None or self.status in (408, 409, 429) or self.status >= 500


def resource(api_version: str, kind: str) -> type:
    """The lightkube resource class of a kind (builtin, or MoEDeployment)."""
    return codecs.resource_registry.load(api_version, kind)


def _what(verb: str, obj: dict) -> str:
    return f"{verb} {obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"


class Kube:
    """The Kubernetes API calls the operator makes (see the module's docstring)."""

    def __init__(self, config: KubeConfig, timeout: tuple[float, float] = API_TIMEOUT):
        self.config = config
        self.timeout = timeout
        self._clients = weakref.WeakKeyDictionary()  # event loop → AsyncClient

    @classmethod
    def from_environment(cls) -> Kube:
        """Connect as kubectl does: the pod's service account in a cluster, else KUBECONFIG / ~/.kube/config."""
        return cls(KubeConfig.from_env())

    @classmethod
    def for_url(cls, url: str) -> Kube:
        """A plain-HTTP API server without authentication (tests' in-memory emulator)."""
        return cls(KubeConfig.from_one(cluster=Cluster(server=url.rstrip("/")), user=User()))

    def _client(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = AsyncClient(
                self.config,
                field_manager=FIELD_MANAGER,
                timeout=httpx.Timeout(self.timeout[1], connect=self.timeout[0]),
            )
        return client

    @staticmethod
    async def _call(what: str, call):
        try:
            return await call
        except ApiError as e:
            raise KubeError(e.status.code, f"{what}: {e.status.message}") from None
        except httpx.HTTPStatusError as e:  # an error answer without a Kubernetes Status body
            raise KubeError(e.response.status_code, f"{what}: {e.response.text[:300]}") from None
        except httpx.HTTPError as e:  # connection refused, TLS, timeouts: no response at all
            raise KubeError(None, f"{what}: {type(e).__name__}: {e}") from None

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            obj = await self._call(
                f"GET {kind} {namespace}/{name}",
                self._client().get(resource(api_version, kind), name, namespace=namespace),
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return obj.to_dict()

    async def apply(self, obj: dict) -> dict:
        """Server-side apply (this operator owns the fields it sets, forced); create when the server does not
        know the object (an API without server-side apply answers 404)."""
        model = codecs.from_dict(obj)
        try:
            out = await self._call(_what("apply", obj), self._client().apply(model, force=True))
        except KubeError as e:
            if e.status != 404:
                raise
            out = await self._call(_what("apply", obj), self._client().create(model))
        return out.to_dict()

    async def create_once(self, obj: dict) -> bool:
        """Create `obj` unless it exists (409: someone — another replica, an earlier run — was first; theirs is
        kept). Returns whether this call created it."""
        try:
            await self._call(_what("create", obj), self._client().create(codecs.from_dict(obj)))
        except KubeError as e:
            if e.status == 409:
                return False
            raise
        return True

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete an object (its dependents in the background, as kubectl does); False when it was not there."""
        try:
            await self._call(
                f"delete {kind} {namespace}/{name}",
                self._client().delete(resource(api_version, kind), name, namespace=namespace),
            )
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def read_log(self, namespace: str, pod: str, container: str, tail_lines: int = 20) -> str:
        """The last lines of a container's log (as `kubectl logs --tail`)."""

        async def lines() -> str:
            return "".join(
                [
                    line
                    async for line in self._client().log(
                        pod, namespace=namespace, container=container, tail_lines=tail_lines
                    )
                ]
            )

        return await self._call(f"log {namespace}/{pod}/{container}", lines())

    async def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        """A merge patch of a MoEDeployment's status subresource."""
        out = await self._call(
            f"patch {KIND} {namespace}/{name} status",
            self._client().patch(
                MoEDeployment.Status, name, {"status": status}, namespace=namespace, patch_type=PatchType.MERGE
            ),
        )
        return out.to_dict()
