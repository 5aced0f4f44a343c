"""Whose a stored response is: the client key that created it, as a tag in its id.

With client keys configured (auth.api_keys_env), a stored response, its conversation and its follow-ups
belong to the key that created it: another key is told the id does not exist, as an unknown id is. The tag
is a digest of the key, written into the id the router makes (router/apis/responses/ids.py) and kept
beside a client's own id, so that every worker and replica checks it with no state of its own. A digest of
48 bits tells nothing of a key, and no other key has it by chance (one in 2^48).
"""

from __future__ import annotations

import hashlib

OWNER_CHARS = 12
UNSCOPED = "0" * OWNER_CHARS  # without client keys, every response's
_DOMAIN = b"kvroute stored response owner\x00"  # so the tag is no digest of the key used elsewhere


def owner_tag(key: str) -> str:
    return hashlib.sha256(_DOMAIN + key.encode()).hexdigest()[:OWNER_CHARS]
