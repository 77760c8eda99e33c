"""A bad values file fails `helm template` (hence `helm install`) before anything is created,
with a message that names the key: values.schema.json for types, unknown keys and impossible
values; templates/validate.yaml for what spans keys."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.chart import template

BAD_VALUES = {
    "wrong_type": ({"decode": {"replicas": "two"}}, "at '/decode/replicas': got string, want integer"),
    "unknown_key_under_a_role": ({"prefill": {"replica": 2}},
                                 "at '/prefill': additional properties 'replica' not allowed"),
    "unknown_engine_key_under_a_role": ({"decode": {"engine": {"blockSze": 32}}},
                                        "at '/decode/engine': additional properties 'blockSze' not allowed"),
    "negative_replicas": ({"prefill": {"replicas": -1}}, "at '/prefill/replicas': minimum: got -1, want 0"),
    "zero_router_workers": ({"router": {"workers": 0}}, "at '/router/workers': minimum: got 0, want 1"),
    "api_key_enabled_without_its_secret": ({"apiKey": {"enabled": True}},
                                           "at '/apiKey/existingSecret': minLength: got 0, want 1"),
    "admin_key_enabled_without_its_secret": ({"adminKey": {"enabled": True, "existingSecret": ""}},
                                             "at '/adminKey/existingSecret': minLength: got 0, want 1"),
    "cluster_secret_not_created_and_not_named": ({"clusterSecret": {"create": False}},
                                                 "at '/clusterSecret/existingSecret': minLength: got 0, want 1"),
    "external_redis_without_url": ({"redis": {"mode": "external"}}, "at '/redis/url': '' does not match pattern"),
    "external_redis_url_with_credentials": ({"redis": {"mode": "external", "url": "redis://:pw@redis:6379/0"}},
                                            "at '/redis/url': 'redis://:pw@redis:6379/0' does not match pattern"),
    "unknown_redis_mode": ({"redis": {"mode": "sentinel"}}, "at '/redis/mode'"),
    "gpu_memory_utilization_above_one": ({"engine": {"gpuMemoryUtilization": 1.5}},
                                         "at '/engine/gpuMemoryUtilization': maximum: got 1.5, want 1"),
    "engine_nice_above_19": ({"decode": {"engine": {"engineNice": 20}}},
                             "at '/decode/engine/engineNice': maximum: got 20, want 19"),
    "unknown_scaler": ({"router": {"scaler": "ray"}}, "at '/router/scaler'"),
    "bad_memory_quantity": ({"decode": {"resources": {"limits": {"memory": "lots"}}}},
                            "at '/decode/resources/limits/memory': 'lots' does not match pattern"),
    "fractional_gpu": ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 0.5}}}},
                       "at '/decode/resources/limits/nvidia.com~1gpu': got number, want integer"),
    "autoscaling_min_above_max": ({"prefill": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 4}}},
                                  "prefill.autoscaling.minReplicas (5) must not exceed prefill.autoscaling.maxReplicas (4)"),
    "nccl_on_cpu": ({"engine": {"device": "cpu", "kvTransfer": "nccl"}},
                    "prefill: engine.kvTransfer nccl needs GPUs; engine.device is cpu"),
    "no_prefill_and_not_colocated": ({"prefill": {"replicas": 0}}, "prefill.replicas is 0: set router.colocated=true"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_file_is_rejected_naming_the_key(helm, tmp_path, case):
    values, message = BAD_VALUES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(values))
    out = template(helm, path)
    assert out.returncode != 0, f"{case} rendered:\n{out.stdout[:500]}"
    assert message in out.stderr, out.stderr


def test_a_decode_only_cluster_is_fine_when_colocated(helm, tmp_path):
    path = tmp_path / "colocated.yaml"
    path.write_text(yaml.safe_dump({"prefill": {"replicas": 0}, "router": {"colocated": True}}))
    out = template(helm, path)
    assert out.returncode == 0, out.stderr
    assert "- --colocated\n            - \"true\"" in out.stdout
