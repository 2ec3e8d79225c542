"""What every surface builds on: the one generation path (``generation``), session turns
(``turns``), the session store (``store``), tenants, KV pins and their TTLs (``affinity``, ``pin_ttl``),
message conversion (``convert``) and the API errors. Nothing here imports a surface (``agentrt.api``)."""
