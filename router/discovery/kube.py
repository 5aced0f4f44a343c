"""The Kubernetes API server, as discovery uses it: list a collection, watch it, by label selector.

The client is kubernetes_asyncio, chosen by measurement against kmock's API server (docs in README.md,
"Kubernetes"): it runs on aiohttp, the router's own HTTP client, in the router's event loop; it reads
kubeconfig files and in-cluster service accounts as kubectl does; raw JSON decoded here with msgspec listed
300 pods in 65 ms (kr8s: 400 ms, the official client 71 ms on a thread), and a watch event arrived 74 ms after
the change (kr8s 180 ms; the official client 66 ms, but only through a thread per watch). Its errors become
KubeError here, at the edge.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from router.discovery.wire import Status

if TYPE_CHECKING:
    from kubernetes_asyncio import client

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is resumed from where it stood
_CONNECT_TIMEOUT_S = 10.0
_status = msgspec.json.Decoder(Status)


class KubeError(Exception):
    """The API server could not be reached, or answered with an error."""


class Expired(KubeError):
    """410 Gone: the server's history no longer reaches the watch's resourceVersion; list again."""


class Kube:
    """```
    async with await Kube.connect(kubeconfig=None) as kube:
        listing = await kube.get("/api/v1/namespaces/default/pods", {"labelSelector": "app=vllm"})
        async for line in kube.watch("/api/v1/namespaces/default/pods", {...}): ...
    ```"""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api

    @classmethod
    async def connect(cls, kubeconfig: str | None) -> Kube:
        """kubeconfig: that file; None: the pod's service account when in a pod, else $KUBECONFIG or
        ~/.kube/config."""
        # Imported here, by a router that discovers: importing the client takes half a second of every
        # other router's start.
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        try:
            if kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                await config.load_kube_config(
                    config_file=kubeconfig, client_configuration=configuration, persist_config=False
                )
        except (config.ConfigException, OSError) as exc:
            raise KubeError(f"no Kubernetes configuration: {exc}") from exc
        return cls(client.ApiClient(configuration))

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._api.close()

    async def get(self, path: str, query: dict[str, str]) -> bytes:
        response = await self._request(path, query, aiohttp.ClientTimeout(total=30))
        try:
            return await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"GET {path}: {exc!r}") from exc
        finally:
            response.release()

    async def watch(self, path: str, query: dict[str, str]) -> AsyncIterator[bytes]:
        """The watch's events, a line of JSON each, until the server ends it."""
        query = query | {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        # No read timeout: a quiet fleet sends nothing for minutes; the server's timeoutSeconds ends it.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S)
        response = await self._request(path, query, timeout)
        try:
            async for line in response.content:
                if line.strip():
                    yield line
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(f"watch {path}: {exc!r}") from exc
        finally:
            response.release()

    async def _request(
        self, path: str, query: dict[str, str], limits: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        from kubernetes_asyncio.client import ApiException  # imported by connect() already

        try:
            response: aiohttp.ClientResponse = await self._api.call_api(
                path,
                "GET",
                query_params=list(query.items()),
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=limits,
                _return_http_data_only=True,
            )
        except (aiohttp.ClientError, TimeoutError, ApiException) as exc:
            raise KubeError(f"GET {path}: {exc!r}") from exc
        if response.status >= 400:
            body = await response.read()
            response.release()
            try:
                message = _status.decode(body).message
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                message = body[:200].decode(errors="replace")
            raise error(response.status, message, f"GET {path}")
        return response


def error(status: int, message: str | None, what: str) -> KubeError:
    """The error an answer (or a watch's ERROR event) with status stands for."""
    kind = Expired if status == 410 else KubeError
    return kind(f"{what}: {status} {message or ''}".rstrip())


def own_namespace() -> str:
    """The namespace of the pod the router runs in, else default."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
