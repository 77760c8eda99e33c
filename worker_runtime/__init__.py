"""What hosts a worker in a process: the role registry, assembly (engine, servicer,
heartbeat, block events, metrics), drain on SIGTERM. The workers themselves live in
prefill_worker/ and decode_worker/; this package wires one into a running process."""
