"""Cluster state: Redis keys, heartbeat snapshots, block events, the cluster-wide view and metrics."""
