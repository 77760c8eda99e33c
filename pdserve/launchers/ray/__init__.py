"""`pdserve up --launcher ray`: the same cluster (specs, Redis state, data channel) placed by Ray.

    args.py       the flags: --launcher, --ray-address, each role's resources
    placement.py  RolePlacement (a role's Ray resources) and the address rule for actors
    actors.py     the Ray actors: ComponentActor (a worker or the router, in-process) and
                  RedisActor (the embedded Redis)
    handles.py    driver-side handles: an actor as the supervisor's Process, Redis as
                  EmbeddedRedis's interface
    cluster.py    RayCluster: LocalCluster's start / reconcile / stop with actors instead of
                  child processes; `pdserve down --launcher ray`

Importing this package does not import Ray; cluster.py and actors.py do (`pip install
pdserve[ray]`).
"""
