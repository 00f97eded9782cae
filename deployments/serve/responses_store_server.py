"""ResponseStoreServer: the app's stored responses, in one place for every ingress replica.

The ingress autoscales; a stored response must be found by whichever ingress replica the next
request reaches, so the store is a deployment of its own with exactly one replica (no CPU of
its own: it only keeps dicts), which every OpenAIIngress replica calls through its handle
(`HandleStore`). A restart of that replica loses what was stored: the next turn naming a lost
id gets the same 404 as an unknown one, and the conversation starts again.
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.frontend.responses.store import (
    Body,
    Images,
    LocalStore,
    Messages,
    ResponseStore,
    StoredResponse,
)


@serve.deployment(name="ResponseStore", num_replicas=1, ray_actor_options={"num_cpus": 0})
class ResponseStoreServer(LocalStore):
    """LocalStore's methods, called through the handle. NOTE: a 404 APIError crosses whole."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        super().__init__(ResponseStore(ttl_s, max_entries))


class HandleStore:
    """`Store` (deployments/frontend/responses/store.py) over the ResponseStore deployment's
    handle."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def put(
        self, body: Body, messages: Messages, session_id: str, images: Images | None = None
    ) -> None:
        await self.handle.put.remote(body, messages, session_id, images)

    async def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        return await self.handle.get.remote(response_id, param)

    async def delete(self, response_id: str) -> None:
        await self.handle.delete.remote(response_id)
