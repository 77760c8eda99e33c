"""The profile-free planner: live measurements -> prefill and decode counts (model), the
collector that measures, the autoscaler that applies them through the scaler, GET /v1/plan."""
