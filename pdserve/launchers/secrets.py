"""How `pdserve up` hands secrets to its children: the environment, never argv.

- the cluster secret ($PDSERVE_CLUSTER_SECRET): the user's ($PDSERVE_CLUSTER_SECRET or
  $PDSERVE_CLUSTER_SECRET_FILE, inherited), else one generated for this run;
- the Redis password ($PDSERVE_REDIS_PASSWORD): the embedded server's, or the one in
  --redis-url (stripped off the URL the children get);
- the API key ($PDSERVE_API_KEY) when given as --api-key (which `pdserve up`'s own argv then
  shows: a warning recommends $PDSERVE_API_KEY or $PDSERVE_API_KEY_FILE, which are inherited).
  The admin key has no flag on `up`: $PDSERVE_ADMIN_KEY / _FILE are inherited.
"""

from __future__ import annotations

from collections.abc import Mapping

from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, generate_secret
from router.cluster.redis_settings import RedisAuth

API_KEY_ENV = "PDSERVE_API_KEY"
API_KEY_WARNING = ("pdserve up: --api-key is visible to every user of this host (ps); prefer "
                   "PDSERVE_API_KEY or PDSERVE_API_KEY_FILE in the environment")


def secrets_env(environ: Mapping[str, str], redis_auth: RedisAuth, api_key: str | None) -> dict[str, str]:
    """The variables to add to the children's environment: a generated cluster secret unless
    the user set one, the Redis credentials, the API key given on the command line."""
    env = redis_auth.child_env()
    if not environ.get(CLUSTER_SECRET_ENV) and not environ.get(CLUSTER_SECRET_FILE_ENV):
        env[CLUSTER_SECRET_ENV] = generate_secret()
    if api_key:
        env[API_KEY_ENV] = api_key
    return env
