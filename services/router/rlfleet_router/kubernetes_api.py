"""The few Kubernetes API calls the router makes (list and delete core/v1 pods, list discovery.k8s.io/v1
EndpointSlices), over httpx, each bounded by `kubernetes_timeout_secs` per step and whole (`http_deadline`).

In a pod, the API server, token and CA come from the service account mount and the
`KUBERNETES_SERVICE_HOST/PORT` variables, as every in-cluster client finds them; `kubernetes_api_url`
points elsewhere (a `kubectl proxy`, a test server). The token is read on every call because
projected service-account tokens are rotated on disk. The router's role needs `list` and `delete` on pods
(restarts) and `list` on `endpointslices` in API group `discovery.k8s.io` (discovery) in its namespace, as the
Helm chart's Role grants.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from rlfleet.errors import Unavailable
from rlfleet_router.config import RouterConfig
from rlfleet_router.http_deadline import DeadlineTransport

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesAPI:
    def __init__(
        self, base_url: str, namespace: str, token_path: Path | None, ca_path: Path | None, timeout_secs: float
    ) -> None:
        self.namespace = namespace
        self._token_path = token_path
        verify = str(ca_path) if ca_path is not None and ca_path.exists() else True
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_secs,
            transport=DeadlineTransport(httpx.AsyncHTTPTransport(verify=verify, trust_env=False)),
            trust_env=False,
        )

    @classmethod
    def from_config(cls, config: RouterConfig) -> KubernetesAPI:
        namespace = config.kubernetes_namespace
        if namespace is None:
            namespace_file = SERVICE_ACCOUNT / "namespace"
            namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
        if config.kubernetes_api_url:
            return cls(config.kubernetes_api_url, namespace, None, None, config.kubernetes_timeout_secs)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): set kubernetes_api_url")
        return cls(
            f"https://{url_host(host)}:{port}",  # an IPv6 cluster's service host is a bare address
            namespace,
            SERVICE_ACCOUNT / "token",
            SERVICE_ACCOUNT / "ca.crt",
            config.kubernetes_timeout_secs,
        )

    async def list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        return await self._list(f"/api/v1/namespaces/{self.namespace}/pods", label_selector)

    async def list_endpoint_slices(self, label_selector: str) -> list[dict[str, Any]]:
        """The EndpointSlices matching `label_selector` (their controller copies a Service's labels onto them)."""
        return await self._list(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices", label_selector)

    async def delete_pod(self, name: str, uid: str) -> None:
        """Deletes pod `name` if it is still the pod `uid` (a precondition: a replacement under the same name, as a
        StatefulSet makes, is left alone); gone or replaced already is not an error."""
        options = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        await self._call("DELETE", path, body=options, allowed=(404, 409))

    async def close(self) -> None:
        await self._client.aclose()

    async def _list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else {}
        body = await self._call("GET", path, params=params)
        items = body.get("items") if isinstance(body, dict) else None
        return items if isinstance(items, list) else []

    async def _call(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
        allowed: tuple[int, ...] = (),
    ) -> Any:
        """The JSON answer; None for a status in `allowed` (404: gone already, say)."""
        headers = {"accept": "application/json"}
        if self._token_path is not None and self._token_path.exists():
            headers["authorization"] = f"Bearer {self._token_path.read_text().strip()}"
        try:
            response = await self._client.request(method, path, params=params, headers=headers, json=body)
        except httpx.HTTPError as exc:
            raise Unavailable(f"Kubernetes API {method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code in allowed:
            return None
        if response.status_code >= 300:
            raise Unavailable(f"Kubernetes API {method} {path}: HTTP {response.status_code}: {excerpt(response)}")
        try:
            return response.json()
        except ValueError as exc:  # a proxy's HTML page, a body cut short: the API server's answer never came
            raise Unavailable(
                f"Kubernetes API {method} {response.url}: HTTP {response.status_code} but not JSON ({exc}): "
                f"{excerpt(response)}"
            ) from exc


def excerpt(response: httpx.Response) -> str:
    """The start of `response`'s body on one line (an HTML page's lines would split the log line it goes into)."""
    return " ".join(response.text[:300].split()) or "(empty body)"


def url_host(ip: str) -> str:
    """An IP as a URL's host: an IPv6 address in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not pod.get("metadata", {}).get("deletionTimestamp") and bool(pod["status"].get("podIP"))
