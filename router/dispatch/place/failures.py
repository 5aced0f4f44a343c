"""How an attempt at an instance can fail before it answers, as aiohttp reports it."""

from __future__ import annotations

import aiohttp

# No connection to the instance: nothing was sent. A connect timeout is also a TimeoutError, so it is caught
# before the timeouts of requests that were sent.
NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# The instance dropped the connection before answering: it died or restarted.
DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError)
# The router's key refused (clients' never reach engines), which vLLM checks before anything else.
REFUSED_CREDENTIALS = (401, 403)
# Refusals that say nothing of the request as the client sent it: the key, or an engine too busy for it.
NOT_THE_REQUESTS_FAULT = (*REFUSED_CREDENTIALS, 429)
