"""A fake Kubernetes API server for the router's restarter and discovery: the calls they make, answered as the
API server answers them.

It serves core/v1 pods of one namespace (list with labelSelector, delete with a uid precondition, a controller
that replaces a deleted pod) and the discovery.k8s.io/v1 EndpointSlices of the engine Service `engines`, as the
EndpointSlice controller writes them: the Service's labels plus `kubernetes.io/service-name` and
`endpointslice.kubernetes.io/managed-by`, every pod with an IP as an endpoint whose `conditions.ready` says
whether it is Ready (not-ready pods are listed, not left out), at most `max_endpoints_per_slice` endpoints per
slice, one set of slices per address family of a dual-stack Service, and one slice with `endpoints: null` for a
Service without pods. The controller acts as a Deployment (the new pod has a new name) or as a StatefulSet (the
same name, a new uid and IP; each endpoint carries the pod's `hostname` and `targetRef`, as for a StatefulSet
behind a headless Service). The core/v1 Endpoints API is not served: the router must not need it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

SERVICE = "engines"
NAMESPACE = "rl"
SERVICE_LABELS = {"app.kubernetes.io/component": "engine"}


@dataclass
class FakeKubernetes:
    """core/v1 pods and discovery.k8s.io/v1 EndpointSlices of one namespace, with a controller replacing deleted
    pods."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    ready_after_polls: int = 2
    stateful: bool = False
    """The controller is a StatefulSet (a replacement keeps the pod's name) rather than a Deployment."""
    dual_stack: bool = False
    """Pods have an IPv6 address beside their IPv4 one, and the Service slices both families."""
    max_endpoints_per_slice: int = 100
    ports: list[dict[str, Any]] | None = field(
        default_factory=lambda: [{"name": "http", "port": 30000, "protocol": "TCP"}]
    )
    """The Service's ports as its slices list them; None: a slice that names none (every port)."""
    _ips: itertools.count = field(default_factory=lambda: itertools.count(20))
    _uids: itertools.count = field(default_factory=itertools.count)

    def add_pod(self, name: str, ip: str, ready: bool = True, age_secs: float = 3600.0) -> None:
        created = datetime.now(UTC) - timedelta(seconds=age_secs)
        ips = [ip, f"fd00::{ip.rsplit('.', 1)[-1]}"] if self.dual_stack else [ip]
        self.pods[name] = {
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "uid": f"uid-{next(self._uids)}",
                "labels": dict(SERVICE_LABELS),
                "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            },
            "status": {
                "podIP": ip,
                "podIPs": [{"ip": a} for a in ips],
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def _controller_tick(self) -> None:
        for pod in self.pods.values():
            waits = pod.setdefault("_polls", 0)
            pod["_polls"] = waits + 1
            if waits + 1 >= self.ready_after_polls:
                pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def endpoint_slices(self) -> list[dict[str, Any]]:
        """The Service's EndpointSlices as the EndpointSlice controller writes them."""
        slices: list[dict[str, Any]] = []
        labels = {
            **SERVICE_LABELS,
            "kubernetes.io/service-name": SERVICE,
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
        }
        for family in ("IPv4", "IPv6") if self.dual_stack else ("IPv4",):
            endpoints = [self._endpoint(pod, family) for pod in self.pods.values() if pod["status"].get("podIP")]
            size = self.max_endpoints_per_slice
            # A Service without pods keeps one slice, its endpoints null.
            chunks: list[list[dict[str, Any]] | None] = [
                endpoints[i : i + size] for i in range(0, len(endpoints), size)
            ]
            chunks = chunks or [None]
            for i, chunk in enumerate(chunks):
                suffix = hashlib.sha256(f"{family}-{i}".encode()).hexdigest()[:5]
                slices.append(
                    {
                        "metadata": {
                            "name": f"{SERVICE}-{suffix}",
                            "namespace": NAMESPACE,
                            "generateName": f"{SERVICE}-",
                            "labels": labels,
                            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": SERVICE}],
                        },
                        "addressType": family,
                        "endpoints": chunk,
                        "ports": self.ports,
                    }
                )
        return slices

    def _endpoint(self, pod: dict[str, Any], family: str) -> dict[str, Any]:
        ready = pod["status"]["conditions"][0]["status"] == "True"
        ips = [a["ip"] for a in pod["status"]["podIPs"]]
        endpoint: dict[str, Any] = {
            "addresses": [next(a for a in ips if (":" in a) == (family == "IPv6"))],
            "conditions": {"ready": ready, "serving": ready, "terminating": False},
            "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod["metadata"]["name"]},
        }
        if self.stateful:
            endpoint["hostname"] = pod["metadata"]["name"]
        return endpoint

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def list_pods(ns: str, labelSelector: str | None = None) -> dict[str, Any]:  # noqa: N803 - the API's name
            self._controller_tick()
            pods = [p for p in self.pods.values() if matches(p, labelSelector)]
            items = [{k: v for k, v in p.items() if not k.startswith("_")} for p in pods]
            return {"kind": "PodList", "apiVersion": "v1", "items": items}

        @app.delete("/api/v1/namespaces/{ns}/pods/{name}")
        async def delete_pod(ns: str, name: str, request: Request) -> JSONResponse:
            if name not in self.pods:
                return JSONResponse({"kind": "Status", "reason": "NotFound", "code": 404}, status_code=404)
            options = json.loads(await request.body() or b"{}")
            uid = options.get("preconditions", {}).get("uid")
            if uid is not None and uid != self.pods[name]["metadata"]["uid"]:
                return JSONResponse({"kind": "Status", "reason": "Conflict", "code": 409}, status_code=409)
            self.deleted.append(name)
            del self.pods[name]
            replacement = name if self.stateful else f"engine-{next(self._ips)}"
            self.add_pod(replacement, f"10.0.0.{next(self._ips)}", ready=False, age_secs=0)
            return JSONResponse({"kind": "Pod", "metadata": {"name": name}})

        @app.get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices")
        async def list_endpoint_slices(ns: str, labelSelector: str | None = None) -> dict[str, Any]:  # noqa: N803
            items = [s for s in self.endpoint_slices() if ns == NAMESPACE and matches(s, labelSelector)]
            return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "items": items}

        return app


def matches(item: dict[str, Any], selector: str | None) -> bool:
    """An equality-based label selector (`k=v,k2=v2`), as the API server applies it."""
    wanted = dict(part.split("=", 1) for part in selector.split(",")) if selector else {}
    labels = item["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())
